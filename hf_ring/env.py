"""``python -m hf_ring.env``: what to paste into a bug report.

Prints each upstream package's installed version against its tested range (the table in
``hf_ring.patches.versions``), the torch build and its devices, whether
``attn_implementation="ring_flash"`` registered, where hf_ring was imported from (and its
git commit, for a checkout), the attention kernels that run here per
device and dtype (``hf_ring.kernels`` registry), and what hf_ring refuses with this set of
packages (each with the error it raises).

Why a module of its own: it reads every layer (it runs ``import hf_ring``) and must keep
printing whatever is missing or refused, so every probe catches and reports. Never imports
deepspeed or peft (their metadata is enough); imports TRL to ask ``hf_ring.trl`` itself.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

import hf_ring
from hf_ring.hf import availability
from hf_ring.kernels import available_backends
from hf_ring.kernels.registry import registered_backends
from hf_ring.patches import deepspeed as deepspeed_patches
from hf_ring.patches import peft as peft_patches
from hf_ring.patches import versions

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def package_lines() -> list[str]:
    """One line per upstream package: installed version, tested range, what hf_ring does
    with this version (``versions.status``: the word is what its ``checked_by`` module
    does) and what hf_ring uses it for."""
    lines = []
    for name, tested in versions.TESTED.items():
        installed = versions.installed(name) or "-"
        lines.append(f"  {name:<13} {installed:<14} {tested.describe():<56} {versions.status(name)}; {tested.role}")
    return lines


def torch_lines() -> list[str]:
    """The torch build, CUDA and the devices it sees."""
    cuda = torch.cuda.is_available()
    lines = [
        f"  torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, CUDA available: {'yes' if cuda else 'no'}"
        + (f", cuDNN {torch.backends.cudnn.version()}" if cuda else "")
        + f", threads {torch.get_num_threads()}"
    ]
    for i in range(torch.cuda.device_count() if cuda else 0):
        major, minor = torch.cuda.get_device_capability(i)
        memory = torch.cuda.get_device_properties(i).total_memory / 2**30
        lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)}, sm{major}{minor}, {memory:.0f} GiB")
    return lines


def kernel_lines() -> list[str]:
    """The backends that run on each device type here, per dtype, in ``backend="auto"``'s order."""
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    lines = [f"  registered: {', '.join(registered_backends())}"]
    for device in devices:
        for dtype in _DTYPES:
            names = available_backends(device, dtype)
            lines.append(f"  {device} {str(dtype).removeprefix('torch.')}: {', '.join(names) or 'none'}")
    return lines


def _trl_trainers() -> str:
    import hf_ring.trl  # its import runs the checks of TRL and transformers

    return "available: " + ", ".join(name for name in hf_ring.trl.__all__ if name.endswith("Trainer"))


def _deepspeed() -> str:
    installed = versions.installed("deepspeed")
    if installed is None:
        raise RuntimeError(f"deepspeed is not installed: `{versions.TESTED['deepspeed'].install_hint()}`")
    # The check hf_ring's DeepSpeed path runs (from the metadata: deepspeed is not imported).
    deepspeed_patches.check_version(installed)
    return f"available ({versions.status('deepspeed')})"


def _peft() -> str:
    installed = versions.installed("peft")
    if installed is None:
        raise RuntimeError("peft is not installed")
    # The check patches/peft.py runs on every PEFT model it meets (from the metadata: peft
    # is not imported); each internal it reads is checked too, refused by name if changed.
    peft_patches.check_version(installed)
    return (f"available ({versions.status('peft')}); hf_ring.patches.peft reads its ModulesToSaveWrapper "
            "internals (the chunked loss under modules_to_save=['lm_head']) and sets TP LoRA widths")


def source_line() -> str:
    """Where this hf_ring was imported from, and its git commit when that is a checkout (an
    editable install; ``+changes`` when the working tree differs from the commit)."""
    folder = Path(hf_ring.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=folder, capture_output=True,
                                text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"  {folder} (git not run: {type(error).__name__})"
    if commit.returncode != 0:
        return f"  {folder} (not a git checkout)"
    return f"  {folder}, commit {commit.stdout.strip()}" + (" +changes" if changed.stdout.strip() else "")


def _ring_flash() -> str:
    availability.require('attn_implementation="ring_flash"')
    return "registered"


FEATURES: dict[str, Callable[[], str]] = {
    'attn_implementation="ring_flash", RingTrainer': _ring_flash,
    "hf_ring.trl": _trl_trainers,
    "DeepSpeed ZeRO-2/3": _deepspeed,
    "PEFT": _peft,
}


def feature_lines() -> list[str]:
    """Each optional feature: available, or refused with the error hf_ring raises."""
    lines = []
    for name, probe in FEATURES.items():
        try:
            lines.append(f"  {name}: {probe()}")
        except Exception as error:  # noqa: BLE001 - reported, which is this module's job
            lines.append(f"  {name}: REFUSED: {type(error).__name__}: {error}")
    return lines


def report() -> str:
    """The whole report, as printed by ``python -m hf_ring.env``."""
    sections = [
        [f"hf_ring {hf_ring.__version__}, Python {platform.python_version()}, {platform.platform()}",
         source_line()],
        ["upstream packages (installed, tested range, status):", *package_lines()],
        ["torch:", *torch_lines()],
        ["attention kernels that run here:", *kernel_lines()],
        ["features:", *feature_lines()],
    ]
    return "\n".join("\n".join(section) for section in sections)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
