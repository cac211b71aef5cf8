"""Generation under context parallelism: a prompt prefilled by the ring into a cache each
rank of the CP group holds a share of (``cache``), decode steps that attend every share
exactly (``attention``), and the hooks that turn a ``generate()`` call made alike on every
rank into those forwards (``entry``).

Part of the transformers integration. Must not import the Trainer, TRL, or hf_ring's
training and memory layers. This package imports only ``cache`` on import: the guard's
context refers to it, and ``entry`` sits above the guard.
"""

from hf_ring.hf.generation.cache import DECODE_MODES, CacheStep, Generation, ShardedCache

__all__ = ["DECODE_MODES", "CacheStep", "Generation", "ShardedCache"]
