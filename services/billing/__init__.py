"""The billing subscriber: usage per namespace and DeviceClass, per hour (``dracap usage``)."""
