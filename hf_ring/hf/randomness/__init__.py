"""Random draws under context parallelism: dropout (PEFT's ``lora_dropout`` included) and MoE
router noise give each token what one process running the full sequence gives it.

``ops`` sorts torch's random ops by how they are treated; ``draws`` owns
:class:`OneProcessDraws`, the ``TorchFunctionMode`` that makes a random op on a
sequence-sharded tensor on the full sequence's shape and keeps this rank's tokens (and
refuses, by name, the random ops it cannot make so); ``scope`` puts it in force in a
guarded forward and in a checkpointed layer's recompute; ``refusals`` holds what callers
use where no draw can match one process's (rows laid out otherwise, a split tower). The guard (``hf_ring.hf.guard``)
builds one per CP forward from what it validated. docs/randomness.md says what is covered,
the cost, and what is refused.

Part of the transformers integration: must not import the Trainer, TRL, or hf_ring's
training and memory layers.
"""
