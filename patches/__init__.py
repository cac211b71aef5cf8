"""Version-specific patches of upstream libraries, one module per library."""
