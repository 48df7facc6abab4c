"""The audit subscriber: who did what to which share, when and why (``dracap audit``)."""
