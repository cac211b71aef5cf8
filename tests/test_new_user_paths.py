"""What a new user hit (issue 51, item 3): each case as the user met it, cheap.

- The README's "three things you touch" under ``torchrun`` on a CPU-only machine with plain
  ``TrainingArguments``: transformers then reports a world of 1 (its Accelerator runs
  without the launched process group unless ``use_cpu=True``), and hf_ring refuses on every
  rank; the refusal must name ``use_cpu=True``, the one thing that fixes it. Gloo world of 2,
  spawned, the launcher's environment set as torchrun sets it.
- The examples' ``share_cores``: torch's thread count is the user's where the user chose one
  (``OMP_NUM_THREADS``, ``torch.set_num_threads``); only a launcher's default of one thread
  per process is replaced by the process's share of the cores. In process.
- Generation under CP from a checkpoint (each process's generators seeded apart, as torch
  seeds a new process): greedy runs and gives one process's tokens; sampling is refused on
  every rank. Gloo world of 2. (The example's own saved model at cp 2: test_trainer_cp.py.)
- ``--train_file`` (issue 50): the examples' reader of your own documents, in process. (The
  example trained on them at cp 2 against cp 1: test_trainer_cp.py.)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from distributed import free_port, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _plain_training_arguments_on_rank(rank: int, world: int, tmp: str, port: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_ring

    # What torchrun puts in each process's environment.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    model.set_attn_implementation("ring_flash")
    plugin = hf_ring.RingAttentionPlugin(cp_size=2)
    args = TrainingArguments(output_dir=tmp, report_to=[], max_steps=1)  # no use_cpu: the README's snippet
    try:
        hf_ring.RingTrainer(model=model, args=args, ring_plugin=plugin,
                            data_collator=plugin.make_collator(pad_token_id=0))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the world of 1 is what transformers reports without a GPU")
def test_plain_training_arguments_on_cpu_are_refused_naming_use_cpu(tmp_path):
    for rank, message in enumerate(run_world(2, _plain_training_arguments_on_rank, str(tmp_path), free_port())):
        assert "the Accelerator sees 1 processes" in message, (rank, message)
        assert "TrainingArguments(use_cpu=True)" in message, (rank, message)


@pytest.fixture
def threads_restored(monkeypatch):
    """Each case starts without the launchers' variables and leaves torch's threads as it found them."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every rule gives one thread")
def test_share_cores_keeps_the_users_thread_count(threads_restored):
    from finetune_llama_long import share_cores

    cores = os.cpu_count()
    # One process, OMP_NUM_THREADS=1 (what the user set; torch read it at start): kept.
    threads_restored.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    share_cores()
    assert torch.get_num_threads() == 1
    # One process, the user's torch.set_num_threads: kept.
    threads_restored.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    share_cores()
    assert torch.get_num_threads() == 1
    # Two launched processes, OMP_NUM_THREADS the user set to 2: kept (not cores // 2).
    threads_restored.setenv("LOCAL_WORLD_SIZE", "2")
    threads_restored.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    share_cores()
    assert torch.get_num_threads() == 2
    # Two launched processes with the launchers' default (torchrun and accelerate launch set
    # OMP_NUM_THREADS=1 when the user did not): each takes its share of the cores.
    threads_restored.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    share_cores()
    assert torch.get_num_threads() == max(1, cores // 2)
    # Two local processes and no OMP_NUM_THREADS at all (torch would give each every core): shared too.
    threads_restored.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(cores)
    share_cores()
    assert torch.get_num_threads() == max(1, cores // 2)


def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


PROMPT = torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(7))


def _generate_with_generators_apart(rank: int, world: int) -> dict:
    import hf_ring

    hf_ring.setup_context_parallel(world)
    model = _tiny_llama("ring_flash")
    out = {}
    # Each process's generators as a new process has them (torch seeds each apart): a checkpoint
    # loaded with from_pretrained draws nothing that would bring them together.
    torch.manual_seed(1000 + rank)
    with torch.no_grad():
        out["greedy"] = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6,
                                       do_sample=False, use_cache=True)
    try:
        with torch.no_grad():
            model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=True,
                           use_cache=True)
        out["sampled"] = "no error"
    except RuntimeError as e:
        out["sampled"] = str(e)
    return out


def test_greedy_generation_runs_with_generators_apart_and_sampling_is_refused():
    """A checkpoint generated from greedily was refused on every run ("the ranks' random
    generators differ ... when sampling"): greedy decoding draws nothing. Sampling from
    generators that differ is still refused, on every rank, at its first decode step."""
    reference = _tiny_llama("sdpa")
    with torch.no_grad():
        greedy = reference.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6,
                                    do_sample=False, use_cache=True)
    for rank, found in enumerate(run_world(2, _generate_with_generators_apart)):
        assert torch.equal(found["greedy"], greedy), (rank, found["greedy"], greedy)
        assert "generate() samples" in found["sampled"] and "random generators differ" in found["sampled"], \
            (rank, found["sampled"])


def test_own_documents_are_read_whole_and_truncated_to_seq_len(tmp_path):
    """examples/text_documents.py: JSON lines, parquet and text files give the same documents;
    each is one example, tokenized whole with its special tokens, one longer than seq_len
    truncated to its first seq_len tokens and counted; the held-out share is seeded."""
    import json

    import datasets
    from long_context_data import ByteTokenizer
    from text_documents import file_sets, load_documents, split_documents, tokenized_documents

    texts = ["short one", "a second document\nover two lines", "x" * 50]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "docs.parquet"))
    (tmp_path / "docs.txt").write_text("\n\n".join(texts) + "\n")
    for name in ("docs.jsonl", "docs.parquet", "docs.txt"):
        assert [t.strip("\n") for t in load_documents(str(tmp_path / name))["text"]] == texts, name
    tokenized, truncated = tokenized_documents(load_documents(str(tmp_path / "docs.jsonl")), ByteTokenizer(), 40)
    assert truncated == 1
    assert tokenized["input_ids"][0] == [257, *b"short one", 258]
    assert list(tokenized["labels"]) == list(tokenized["input_ids"])
    assert tokenized["input_ids"][2] == [257, *b"x" * 39]  # its first 40 tokens, never a second block
    docs = load_documents(str(tmp_path / "docs.jsonl"))
    train, held = split_documents(docs, 0.3, seed=0)
    assert len(held) == 1 and sorted(list(train["text"]) + list(held["text"])) == sorted(texts)
    assert list(split_documents(docs, 0.3, seed=0)[1]["text"]) == list(held["text"])  # the same on every rank
    assert file_sets(str(tmp_path / "docs.jsonl"), None, 0.0, 0)[1] is None
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "no text column"}) + "\n")
    with pytest.raises(ValueError, match="'text' column"):
        load_documents(str(tmp_path / "bad.jsonl"))
