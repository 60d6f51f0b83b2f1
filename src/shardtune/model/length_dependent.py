"""Modules whose weights the loss reaches only when a row is long enough, kept in every rank's gradient.

DeepSeek-V4's heavily compressed attention compresses each block of 128 tokens into one entry: a micro-batch
shorter than a block leaves the compressor's output empty (built from zeros), so its projections, position bias
and norm get no gradient. With two ranks, one holding a long row and one not, the ranks' gradient reductions
differ in size: DDP waits forever for the missing gradients, ZeRO-3 and FSDP2 abort on a collective of another
size. Such a weight is not unused (a long row trains it), so freezing it (model/gradient_probe.py's answer for
structurally unused weights) would be wrong.

Here each such module adds ``0 x`` its trainable weights to its output: on a short micro-batch every weight gets a
gradient of zeros, on every engine and on one process alike, so the ranks reduce the same tensors and the
distributed run equals the one-process run. The classes are listed by name (the table below): which weights are
length-dependent is found by probing every family of transformers' registry at a short and a long length
(tests/unit/test_length_dependent.py), and a family with a length-dependent weight outside the table fails it.

A second table, ROW_DEPENDENT_CALLS, lists modules whose forward calls a submodule as many times as the rows say;
the blocks with a state that packed rows run once per sample (model/packed_state.py) are such modules too. ZeRO-3
gathers the classes of both tables, and those blocks, whole on entry (``zero3_whole_classes``, engines/deepspeed.py): a
length-dependent module so its output hook sees every weight gathered, a row-dependent one so that two ranks do not
gather its submodules' weights in another order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

# class name -> why the loss reaches its weights only on long rows
LENGTH_DEPENDENT: dict[str, str] = {
    "DeepseekV4HCACompressor": "compresses blocks of compress_rate (128) tokens; a shorter row uses no weight of it",
}


# class name -> why the number of times its forward calls a submodule depends on the rows: ZeRO-3 gathers such a
# module whole on entry (engines/deepspeed.py), else two ranks would gather its submodules' weights in another order
ROW_DEPENDENT_CALLS: dict[str, str] = {
    "Qwen4ExpTextQSAIndexer": "calls its key norm once per query position that has a complete block of keys",
}


def zero3_whole_classes(model: torch.nn.Module) -> list[type[torch.nn.Module]]:
    """The model's classes named in either table, and those of blocks run once per packed sample (as many times as
    each rank's rows hold samples), sorted by name: ZeRO-3 gathers each such module whole."""
    from shardtune.model.packed_state import runs_per_sample

    named = LENGTH_DEPENDENT.keys() | ROW_DEPENDENT_CALLS.keys()
    found = {type(module) for module in model.modules() if type(module).__name__ in named or runs_per_sample(module)}
    return sorted(found, key=lambda cls: cls.__name__)


def length_dependent_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if type(module).__name__ in LENGTH_DEPENDENT:
            yield name, module


def keep_length_dependent_in_graph(model: torch.nn.Module) -> list[str]:
    """Hook each length-dependent module so its trainable weights are always in the loss's graph; returns their
    names. The hook runs first among the module's forward hooks (ZeRO-3 and FSDP2 release the gathered weights in
    theirs), while the weights are whole."""
    names = []
    for name, module in length_dependent_modules(model):
        if getattr(module, "_shardtune_anchored", False):
            continue
        module.register_forward_hook(_anchor_output, prepend=True, with_kwargs=True)
        module._shardtune_anchored = True  # type: ignore[assignment]
        names.append(name)
    return names


def _anchor_output(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    if not torch.is_grad_enabled():
        return None
    zero = _zero_from(module, [*args, *kwargs.values()])
    if zero is None:
        return None
    if isinstance(output, torch.Tensor):
        return output + zero.to(output.dtype) if output.is_floating_point() else None
    if isinstance(output, tuple):
        for index, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return (*output[:index], item + zero.to(item.dtype), *output[index + 1:])
    return None


def _zero_from(module: torch.nn.Module, inputs: list[Any]) -> torch.Tensor | None:
    """A zero that depends on one element of each trainable weight (its gradient is zeros of the weight's shape)
    and of each input that carries a gradient: backward then reaches the module's inputs too, which is when
    ZeRO-3 reduces a leaf module's gradients (its backward hook waits for the inputs' gradients)."""
    firsts = [p.reshape(-1)[:1] for p in module.parameters() if p.requires_grad and p.numel() > 0]
    if not firsts:
        return None
    firsts += [item.reshape(-1)[:1] for item in inputs
               if isinstance(item, torch.Tensor) and item.requires_grad and item.numel() > 0]
    return torch.cat([first.float() for first in firsts]).sum() * 0.0
