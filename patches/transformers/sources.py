"""What hf_ring reads from how transformers writes its modeling code: the source of a
forward, and the names a modeling module defines. How a modeling file is written is an
implementation detail of each release, hence here, gated on the releases it was read in
(4.57.6, 5.24.0 and 5.25.0).

- ``logit_transform(model, head_attr)``: what a causal LM's forward does to its LM head's
  output before returning it (the chunked loss recomputes it);
- ``forward_passes_keyword(cls, keyword)``: whether a module's forward passes ``keyword=``
  to a call (model support: an attention layer that hands its ``sliding_window`` to the
  attention function, against one that applies it through the mask only);
- ``attention_class_tables(model_class)``: the tables of attention classes keyed by
  implementation name in a model's modeling module (Falcon's ``FALCON_ATTENTION_CLASSES``),
  which bypass transformers' attention interface;
- ``uses_attention_interface(cls)``: whether a module's class comes from a modeling module
  that dispatches attention through ``ALL_ATTENTION_FUNCTIONS``;
- ``forward_reads_keywords(cls)``: whether a module's forward takes ``**kwargs`` and reads
  them, which is how a forward's keyword arguments reach the attention function.

Falcon is the case in point of the last three: up to 5.24 (read in 4.57.6 and 5.24.0) it
picked its attention class from ``FALCON_ATTENTION_CLASSES``; 5.25 (read in 5.25.0) moved it
onto the attention interface, but its ``FalconModel`` and ``FalconDecoderLayer`` take
``**kwargs`` and drop them. GPT-Neo keeps its table in every release read.

Owns: the readers above. Must not import hf_ring (model support and the chunked loss call in).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
from typing import Any

import torch.nn as nn

from .versions import installed_version


def _forward_source(cls: type) -> str:
    """``cls.forward``'s source; raises OSError or TypeError where it cannot be read."""
    return textwrap.dedent(inspect.getsource(cls.forward))


def forward_passes_keyword(cls: type, keyword: str) -> bool:
    """Whether the source of ``cls.forward`` passes ``keyword=`` (Mistral's
    ``sliding_window=getattr(self.config, "sliding_window", None)``, Qwen2's
    ``sliding_window=self.sliding_window``); a comparison (``keyword ==``) does not count.
    Source that cannot be read counts as not passing.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
    """
    installed_version()
    try:
        source = _forward_source(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\b{re.escape(keyword)}\s*=(?!=)", source) is not None


def _is_attention_class_table(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and "eager" in value
        and all(isinstance(v, type) and issubclass(v, nn.Module) for v in value.values())
    )


def attention_class_tables(model_class: type) -> dict[str, dict]:
    """The dicts of attention classes keyed by implementation name (one has ``"eager"``)
    that ``model_class``'s modeling module defines, by qualified name
    (``"transformers.models.falcon.modeling_falcon.FALCON_ATTENTION_CLASSES"``), in the
    module's order.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
    """
    installed_version()
    module = sys.modules.get(model_class.__module__)
    if module is None:
        return {}
    return {f"{module.__name__}.{name}": table for name, table in vars(module).items()
            if _is_attention_class_table(table)}


def uses_attention_interface(cls: type) -> bool:
    """Whether ``cls``'s modeling module dispatches attention by implementation name: it
    imports transformers' registry under the name ``ALL_ATTENTION_FUNCTIONS`` (4.57 and 5.x alike).

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
    """
    installed_version()
    module = sys.modules.get(cls.__module__)
    return module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module)


def forward_reads_keywords(cls: type) -> bool | None:
    """Whether ``cls.forward`` takes ``**kwargs`` (any name) and reads them anywhere in its
    body: how transformers hands a forward's keyword arguments (flash attention's
    ``cu_seq_lens_q``, hf_ring's validated context) from the base model through each decoder
    layer to the attention function. A forward that takes them and never reads them drops
    them (Falcon on 5.25). None when the source cannot be read.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
    """
    installed_version()
    try:
        tree = ast.parse(_forward_source(cls))
    except (OSError, TypeError, SyntaxError):
        return None
    function = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None:
        return None
    if function.args.kwarg is None:
        return False
    name = function.args.kwarg.arg
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(function))


# ---- what a causal LM does between its LM head and its returned logits (chunked loss) ----

# The statements that rebind ``logits`` after the head in the forwards of transformers
# 4.57.6 and 5.24.0 (ast.unparse'd), and the transformation each sequence computes.
# ``hf_ring.memory.chunked_loss`` recomputes exactly these, chunk by chunk; any other sequence
# is refused there.
_KNOWN_LOGIT_TRANSFORMS: dict[tuple[str, ...], str] = {
    (): "identity",
    (
        "logits = logits / self.config.final_logit_softcapping",
        "logits = torch.tanh(logits)",
        "logits = logits * self.config.final_logit_softcapping",
    ): "final_logit_softcapping",
    ("logits = logits * self.logit_scale",): "logit_scale",
    ("logits = logits / self.config.logits_scaling",): "logits_scaling",
}


def _statements_in_order(tree: Any) -> list:
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr))]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


@functools.lru_cache(maxsize=None)
def _logit_statements(model_class: type, head_attr: str) -> tuple[str, tuple[str, ...]] | str:
    """(the head statement, the statements that rebind ``logits`` after it), or a reason."""
    try:
        source = _forward_source(model_class)
    except (OSError, TypeError) as exc:
        return f"the source of {model_class.__name__}.forward cannot be read ({exc})"
    tree = ast.parse(source)

    def is_head_call(node: Any) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == head_attr and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self")

    head_calls = [n for n in ast.walk(tree) if is_head_call(n)]
    if len(head_calls) != 1:
        return f"{model_class.__name__}.forward calls self.{head_attr}(...) {len(head_calls)} times, not once"
    head, after = None, []
    for node in _statements_in_order(tree):
        if isinstance(node, ast.Expr):
            call = node.value
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "logits"
                    and call.func.attr.endswith("_")):
                return f"{model_class.__name__}.forward changes the logits in place: {ast.unparse(node)}"
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id == "logits" for t in targets):
            continue
        if head is None:
            if not is_head_call(node.value) or not isinstance(node, ast.Assign):
                return f"{model_class.__name__}.forward computes its logits as {ast.unparse(node)}"
            head = ast.unparse(node)
        else:
            after.append(ast.unparse(node))
    if head is None:
        return f"{model_class.__name__}.forward does not assign self.{head_attr}(...) to logits"
    return head, tuple(after)


def logit_transform(model: Any, head_attr: str) -> str:
    """Which transformation ``type(model).forward`` applies to the LM head's output before
    returning it as logits: ``"identity"``, ``"final_logit_softcapping"`` (Gemma 2/3),
    ``"logit_scale"`` (Cohere) or ``"logits_scaling"`` (Granite).

    Args:
        model: a causal LM (``LlamaForCausalLM``, ...), not wrapped.
        head_attr: the attribute of ``model`` that holds its output embeddings (``"lm_head"``).

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
        NotImplementedError: a forward whose logits are anything else (the message quotes it).
    """
    installed_version()
    found = _logit_statements(type(model), head_attr)
    if isinstance(found, str):
        raise NotImplementedError(found)
    _, after = found
    kind = _KNOWN_LOGIT_TRANSFORMS.get(after)
    if kind is None:
        raise NotImplementedError(
            f"{type(model).__name__}.forward transforms the LM head's output in a way hf_ring's chunked "
            f"loss does not reproduce: {'; '.join(after)}"
        )
    return kind
