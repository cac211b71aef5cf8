"""The Ring trainers compose with the stock trainer classes through ``super()``.

Each Ring trainer is ``RingX(<its methods>, RingTrainerBase, X)``; every method it overrides
must reach the next class in the method order, not a TRL class by name. Checked with a
user's own subclass of TRL's trainer placed between them: at cp 1 each call of the trainer
loop's hooks must reach that subclass's override (before this design, six calls went to
``GRPOTrainer.X(self, ...)`` / ``DPOTrainer.X(self, ...)`` directly and skipped it).
No model is built: the instances are made without ``__init__``, with a cp-1 state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from trl import DPOTrainer, GRPOTrainer, RLOOTrainer  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_ring.training.trainer import RingTrainer  # noqa: E402
from hf_ring.training.trainer_base import model_and_training_args, stock_trainer_class  # noqa: E402
from hf_ring.trl import RingDPOTrainer, RingGRPOTrainer, RingRLOOTrainer  # noqa: E402

pytestmark = pytest.mark.quick

# Each hook the trainer loop calls, with arguments of the right arity (the override returns before reading them).
HOOKS = {
    "get_batch_samples": (iter(()), 1, "cpu"),
    "_prepare_inputs": ([{"prompt": "p"}],),
    "_generate_single_turn": ([[1, 2]], None, {}),
    "_get_per_token_logps_and_entropies": (None, None, None, 1),
    "compute_loss": (None, {}),
    "prediction_step": (None, {}, True),
}
DPO_HOOKS = ("get_batch_samples", "compute_loss", "prediction_step")


def _recording(trl_class: type, hooks: tuple[str, ...]) -> type:
    """A user's subclass of ``trl_class`` whose every hook in ``hooks`` records its call."""

    def override(name: str):
        def method(self, *args, **kwargs):
            self.calls.append(name)
            return ("user's", name)

        return method

    return type(f"Users{trl_class.__name__}", (trl_class,), {name: override(name) for name in hooks})


def _instance(ring_class: type, user_class: type):
    composed = type(f"Composed{ring_class.__name__}", (ring_class, user_class), {})
    trainer = object.__new__(composed)
    trainer.calls = []
    trainer.ring_state = SimpleNamespace(cp_size=1, cp_rank=0, dp_size=1, world_size=1)
    trainer.padding_free = False
    return trainer


@pytest.mark.parametrize("ring_class, trl_class", [(RingGRPOTrainer, GRPOTrainer), (RingRLOOTrainer, RLOOTrainer)],
                         ids=["grpo", "rloo"])
def test_rollout_trainers_reach_the_next_class_for_every_hook(ring_class, trl_class):
    hooks = tuple(HOOKS)
    trainer = _instance(ring_class, _recording(trl_class, hooks))
    for name in hooks:
        assert getattr(trainer, name)(*HOOKS[name]) == ("user's", name), name
    assert trainer.calls == list(hooks)


def test_dpo_trainer_reaches_the_next_class_for_every_hook():
    trainer = _instance(RingDPOTrainer, _recording(DPOTrainer, DPO_HOOKS))
    for name in DPO_HOOKS:
        assert getattr(trainer, name)(*HOOKS[name]) == ("user's", name), name
    assert trainer.calls == list(DPO_HOOKS)


def test_the_stock_class_is_the_first_trainer_after_the_ring_classes():
    users = _recording(GRPOTrainer, ("compute_loss",))
    composed = type("Composed", (RingGRPOTrainer, users), {})
    assert stock_trainer_class(composed) is users
    assert stock_trainer_class(RingTrainer) is Trainer
    assert stock_trainer_class(RingDPOTrainer) is DPOTrainer


def test_model_and_arguments_are_bound_to_the_stock_signature(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    model, rewards = object(), [len]
    # GRPOTrainer(model, reward_funcs, args), DPOTrainer(model, ref_model, args), Trainer(model, args).
    assert model_and_training_args(RingGRPOTrainer, (model, rewards, args), {}) == (model, args)
    assert model_and_training_args(RingDPOTrainer, (model,), {"args": args}) == (model, args)
    assert model_and_training_args(RingTrainer, (), {"model": model, "args": args}) == (model, args)
    assert model_and_training_args(RingTrainer, (), {"model_init": len}) == (None, None)
    with pytest.raises(TypeError, match="RingTrainer takes the arguments of Trainer .*unknown_option"):
        model_and_training_args(RingTrainer, (model, args), {"unknown_option": 1})
