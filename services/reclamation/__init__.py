"""The reclamation service: node leases that run out, and fencing (``docs/reclamation.md``)."""
