"""Path selectors over the B×K candidate lattice, one file per method (registered by name on import:
dflash2.registry)."""
