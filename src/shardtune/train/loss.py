"""Next-token cross entropy that never holds the full ``[tokens, vocab]`` logits.

Why this shape:

* The plain path materialises the logits, an fp32 copy of them and the log-softmax, and three such tensors
  are alive when the backward starts: with a 150k vocabulary each is 2.5 GB per 4096 tokens, more than a
  small model's decoder activations. Here the loss is computed ``chunk_size`` trainable tokens at a time from
  the final hidden states and the output layer's weight, and each chunk's gradients (of the hidden states, the
  weight and the bias) are formed right away from the logits it already holds; the backward only scales them
  by the incoming gradient. No logits are recomputed in the backward (recomputing them cost one more head
  matmul per token, a third of a LoRA step's work on a small model: benchmarks/llamafactory_cpu.py).
  Positions whose label is ``IGNORE_INDEX`` get no logits at all: they add nothing to the loss or gradients.
* The chunked computation runs *inside the output layer's own forward call*, during the wrapped model's
  forward. Engines only make a sharded weight whole around the forward and backward of the module that owns
  it: DeepSpeed ZeRO-3 gathers ``lm_head.weight`` in the head's pre-forward hook and again in a pre-backward
  hook it attaches to the head's output; FSDP1/FSDP2 unshard the root unit's parameters (the head lives in the
  root) around the root's forward and backward. Reading the weight anywhere else sees an empty shard. So for
  one forward of the model the head's ``forward`` is replaced by a function that returns the summed loss
  (shaped ``[1, 1, 1]`` so model code that indexes its logits keeps working) and the loss is taken from the
  model's output, the tensor the engines' backward hooks are attached to. The gradients it returns have the
  weight's gathered shape, formed while the engine held it whole, so the engine's gradient hooks see what a
  plain head's backward would give them.
  transformers' causal LMs (5.23: ``LlamaForCausalLM.forward``) call ``self.lm_head(hidden_states[:,
  slice_indices, :])`` with every position when ``logits_to_keep`` is 0, so the head sees ``[batch, seq,
  hidden]`` aligned with the labels; a head called with another shape, or twice, is refused with a remedy.
  Computing the loss outside the model from ``model.model``'s output instead would bypass the engine wrapper's
  forward (DDP's reducer, FSDP's root unshard) and read the weight outside its owner's hooks.
* Heads whose logits the model changes after the head (Gemma's soft-cap, Cohere's and Granite's scales) or
  that are not a plain ``nn.Linear`` (quantized, LoRA on the head) use the plain path, with a warning naming
  the reason; a model that changes the returned value anyway is caught by comparing it with the loss computed.
* LLaMA-Factory's token weightings (``TokenWeighting``): DFT scales each token's cross entropy by its target's
  probability and EAFT by a power of the model's entropy over its 20 largest logits, both weights taken as
  constants (no gradient through them), as LLaMA-Factory's ``dft_loss_func`` / ``eaft_loss_func`` define them. The
  weight is a per-row factor on the row's loss and on its logits' gradient, so both paths apply it the same way.
* ASFT's anchor (``Anchor``, LLaMA-Factory's ``use_asft_loss``): DFT plus ``alpha`` times each token's
  ``KL(reference || policy)`` over the whole vocabulary, the reference's distribution ``q`` given per trainable
  row (train/anchor.py computes it). A row's KL is ``sum(q log q) - sum(q z) + lse(z) sum(q)`` from the policy's
  logits ``z``, and its logits' gradient ``softmax(z) sum(q) - q``: the chunked path forms both from the logits
  it already holds, as it does the cross entropy's.
* Mixed precision follows what autocast does to ``nn.Linear`` in the plain path: chunk logits are computed in
  the autocast dtype, then the loss in fp32; the logits' gradient is rounded to that dtype before both
  matmuls. The weight gradient is summed over chunks in fp32 (also for a bf16 weight, as FSDP's mixed
  precision and DeepSpeed's bf16 hand the head) and rounded to the weight's dtype once.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardtune.config.schema import TrainConfig
from shardtune.data.settings import IGNORE_INDEX
from shardtune.errors import ModelError
from shardtune.model.moe import packed_aux_loss_problem

# The config key's default (its choice is measured in benchmarks/loss_memory.py).
DEFAULT_LOSS_CHUNK_SIZE: int = TrainConfig.loss_chunk_size
# Rows of the head's weight gradient per mixed-precision product (its temporary: 64 MiB at hidden 4096, bf16).
PRODUCT_BLOCK_ROWS = 8192
# Config attributes with which a model rescales or caps the head's logits after the head returns them (the last
# two: xLSTM's and RecurrentGemma's caps).
LOGIT_POSTPROCESSING_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                             "output_multiplier_scale", "output_logit_soft_cap", "logits_soft_cap")


EAFT_TOP_K = 20  # the logits EAFT's entropy is taken over (LLaMA-Factory's _eaft_cross_entropy)
EAFT_ENTROPY_SCALE = 3.0  # and the entropy's divisor there


@dataclass(frozen=True)
class TokenWeighting:
    """``use_dft_loss`` (``kind="dft"``) or ``use_eaft_loss`` with ``eaft_alpha`` (``kind="eaft"``)."""

    kind: str
    alpha: float = 1.0

    @property
    def reads_logits(self) -> bool:
        return self.kind == "eaft"

    def weights(self, logits: torch.Tensor | None, token_loss: torch.Tensor) -> torch.Tensor:
        """Each row's weight (no gradient) from its fp32 logits (EAFT only: the largest are enough) and its cross
        entropy."""
        with torch.no_grad():
            if not self.reads_logits:
                return torch.exp(-token_loss)
            assert logits is not None, "EAFT weighs by the logits"
            top = logits.topk(min(EAFT_TOP_K, logits.size(-1)), dim=-1).values
            log_probs = top - top.logsumexp(dim=-1, keepdim=True)
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
            return (entropy / EAFT_ENTROPY_SCALE).pow(self.alpha)


@dataclass(frozen=True)
class Anchor:
    """ASFT's KL term of one micro-batch: ``probs`` is the reference's next-token distribution at each trainable
    position (``[rows, vocab]``, the rows in the order the loss keeps them: row-major over the shifted labels),
    weighed by ``alpha`` (``asft_alpha``) against the token loss."""

    probs: torch.Tensor
    alpha: float

    def rows(self, start: int, end: int) -> Anchor:
        return Anchor(self.probs[start:end], self.alpha)

    def kl_sum(self, log_probs: torch.Tensor) -> torch.Tensor:
        """``alpha`` x the summed ``KL(q || p)`` of rows whose policy log-probabilities are ``log_probs`` (with
        autograd: the full-logits path)."""
        q = self.probs.to(log_probs.dtype)
        return self.alpha * (torch.xlogy(q, q) - q * log_probs).sum()


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one: position i is scored on token i + 1; the last position on nothing."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


def plain_loss_sum(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                   shifted: bool = False, weighting: TokenWeighting | None = None,
                   anchor: Anchor | None = None) -> torch.Tensor:
    """Summed fp32 cross entropy over the full logits (the reference the chunked path must match). ``shifted``:
    ``labels`` are already each position's next token (a sequence-parallel slice, shifted over the whole row)."""
    shift_logits = logits.float() if shifted else logits[:, :-1, :].float()
    shift_labels = labels if shifted else labels[:, 1:]
    flat_logits, flat_labels = shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1)
    if weighting is None and anchor is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum",
                               label_smoothing=label_smoothing)
    kept = flat_labels != IGNORE_INDEX
    token_loss = F.cross_entropy(flat_logits[kept], flat_labels[kept], reduction="none")
    weighted = token_loss if weighting is None else token_loss * weighting.weights(flat_logits[kept], token_loss)
    if anchor is None:
        return weighted.sum()
    return weighted.sum() + anchor.kl_sum(flat_logits[kept].log_softmax(dim=-1))


def causal_lm_loss_sum(model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
                       chunk_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed next-token cross entropy of one forward of ``model`` on ``inputs``.

    ``chunk_size`` > 0 computes it chunk by chunk inside the output layer (see the module docstring);
    0, or a head that cannot be chunked exactly, takes the full logits. ``label_smoothing`` is torch's
    ``cross_entropy(label_smoothing=...)``: each target keeps ``1 - eps`` and ``eps`` spreads over the vocabulary.
    """
    return causal_lm_loss_terms(model, inputs, labels, chunk_size, label_smoothing)[0]


def causal_lm_loss_terms(model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_size: int,
                         label_smoothing: float = 0.0, router_aux: bool = False, shifted: bool = False,
                         weighting: TokenWeighting | None = None, anchor: Anchor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``causal_lm_loss_sum`` and, with ``router_aux``, the router's auxiliary loss of the same forward (the
    model's ``aux_loss`` with ``output_router_logits=True``; unscaled, a mean over this batch's tokens).
    ``shifted``: ``labels`` are already the next-token targets (``plain_loss_sum``). ``anchor``: ASFT's KL term,
    one row per trainable position."""
    mask = inputs.get("attention_mask")
    if router_aux and mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2):
        raise ModelError(packed_aux_loss_problem())
    call_inputs = {**inputs, "use_cache": False, **({"output_router_logits": True} if router_aux else {})}
    head = chunkable_output_layer(model) if chunk_size > 0 else None
    if head is None:
        output = model(**call_inputs)
        return (plain_loss_sum(output.logits, labels, label_smoothing, shifted, weighting, anchor),
                _aux_loss(output, router_aux))
    targets = labels if shifted else next_token_targets(labels)
    with _head_computes_loss(head, targets, chunk_size, label_smoothing, weighting, anchor) as call:
        output = model(**call_inputs)
    logits, aux = output.logits, _aux_loss(output, router_aux)
    if not call.ran or call.loss is None:
        # The model never called its output layer (it produced the logits some other way), or called it on more
        # than one row per label.
        if logits.shape[:-1] != labels.shape:
            raise ModelError(f"the model's logits {tuple(logits.shape)} do not match the labels "
                             f"{tuple(labels.shape)} (one row of logits per label is needed)")
        return plain_loss_sum(logits, labels, label_smoothing, shifted, weighting, anchor), aux
    if logits.shape != (1, 1, 1) or not torch.equal(logits.detach().reshape(()), call.loss.detach()):
        raise ModelError(f"loss_chunk_size ({chunk_size}): the model changed what its output layer returned (a "
                         "logit cap or scale shardtune does not know); set loss_chunk_size: 0 to use the full logits")
    return logits.reshape(()), aux


def _aux_loss(output: Any, wanted: bool) -> torch.Tensor | None:
    if not wanted:
        return None
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        # Its config has a coefficient the modelling code never uses (Llama 4 in transformers 5.23): what the
        # model defines is trained, as transformers' own loss would be; said once per process.
        if not _NO_AUX_LOSS_SAID:
            _NO_AUX_LOSS_SAID.append(True)
            print("[shardtune] the model returns no router aux_loss although its config has router_aux_loss_coef: "
                  "training without the auxiliary term", file=sys.stderr, flush=True)
        return None
    return aux.reshape(()).float()


_NO_AUX_LOSS_SAID: list[bool] = []
_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """A note on stderr, once per process."""
    if message not in _SAID:
        _SAID.add(message)
        print(f"[shardtune] {message}", file=sys.stderr, flush=True)


# --- which heads can be chunked ---

def chunkable_output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output layer as a plain ``nn.Linear``, or None (with a warning) when chunking cannot be exact."""
    found = _causal_lm(model)
    head = _innermost(found.get_output_embeddings()) if found is not None else None
    reason = unchunkable_reason(found, head)
    if reason is not None:
        warnings.warn(f"loss_chunk_size: computing the loss from the full logits: {reason}", stacklevel=3)
        return None
    if not isinstance(head, torch.nn.Linear):  # unchunkable_reason passes only a plain Linear
        raise RuntimeError(f"loss_chunk_size: output layer {type(head).__name__} passed as a plain Linear")
    return head


def unchunkable_reason(model: torch.nn.Module | None, head: torch.nn.Module | None) -> str | None:
    if model is None or head is None:
        return "the model has no output layer (get_output_embeddings() is None)"
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return f"its output layer is a {type(head).__name__}, not a plain Linear (quantized or adapted head)"
    config = getattr(model, "config", None)
    for key in LOGIT_POSTPROCESSING_KEYS:
        value = getattr(config, key, None)
        if value is not None and value != 1:
            return f"the model rescales or caps its logits after the head ({key}={value})"
    return None


def _causal_lm(model: torch.nn.Module) -> Any:
    """The innermost model that has ``get_output_embeddings``, below engine wrappers that expose it as ``.module``.
    Innermost: DeepSpeed's engine forwards unknown attributes to its module, so it seems to have that method too,
    but its ``config`` is DeepSpeed's, which would hide the model's logit cap (Gemma 2) from the check below."""
    found: torch.nn.Module | None = None
    current: object = model
    while isinstance(current, torch.nn.Module):
        if hasattr(current, "get_output_embeddings"):
            found = current
        current = getattr(current, "module", None)
    return found


def _innermost(head: torch.nn.Module | None) -> torch.nn.Module | None:
    """An FSDP1 unit wrapping the head itself unshards around its inner module's call: patch that one."""
    while head is not None and not isinstance(head, torch.nn.Linear):
        inner = getattr(head, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        head = inner
    return head


# --- the head's forward, replaced for one model call ---

@dataclass
class _HeadCall:
    ran: bool = False
    loss: torch.Tensor | None = None  # None after a call: the head computed its logits (inputs not one per label)


@contextlib.contextmanager
def _head_computes_loss(head: torch.nn.Linear, targets: torch.Tensor, chunk_size: int,
                        label_smoothing: float = 0.0, weighting: TokenWeighting | None = None,
                        anchor: Anchor | None = None) -> Iterator[_HeadCall]:
    call = _HeadCall()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if call.ran:
            raise ModelError(f"loss_chunk_size ({chunk_size}): the model called its output layer twice in one "
                             "forward; set loss_chunk_size: 0")
        call.ran = True
        if hidden.shape[:-1] != targets.shape:
            # Not one row per label (ProphetNet's n-gram streams, (rows, streams, tokens, hidden)): the head
            # computes its logits and the model picks the ones it returns, from which the loss is taken.
            _say_once(f"loss_chunk_size: the output layer's input {tuple(hidden.shape)} is not one row per label "
                      f"{tuple(targets.shape)}: the loss is computed from the model's full logits")
            return torch.nn.functional.linear(hidden, head.weight, head.bias)
        call.loss = linear_cross_entropy_sum(hidden, head.weight, head.bias, targets, chunk_size, label_smoothing,
                                             weighting, anchor)
        # A copy, not a view of the loss: this becomes the wrapped model's output, and FSDP2 hooks its backward on
        # that output and warns on every rank when it is a view (an in-place op there would skip the hook).
        return call.loss.reshape(1, 1, 1).clone()

    # An instance attribute: nn.Module.__call__ still runs every hook around it (mypy models only methods here).
    head.forward = forward  # type: ignore[method-assign, assignment]
    try:
        yield call
    finally:
        del head.forward


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_size: int, label_smoothing: float = 0.0,
                             weighting: TokenWeighting | None = None, anchor: Anchor | None = None
                             ) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets, reduction="sum", label_smoothing=...)`` over rows whose
    target is not IGNORE_INDEX, ``chunk_size`` rows at a time, in the dtype autocast would give the head."""
    rows = hidden.reshape(-1, hidden.size(-1))
    flat = targets.reshape(-1)
    kept = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    if anchor is not None and anchor.probs.size(0) != kept.numel():
        raise RuntimeError(f"the anchor has {anchor.probs.size(0)} rows for {kept.numel()} trainable positions")
    # Even with no trainable token the call stays in the graph, so every rank runs the same hooks and
    # collectives and every parameter gets a (zero) gradient.
    return _ChunkedLinearCrossEntropy.apply(rows.index_select(0, kept), weight, bias, flat.index_select(0, kept),
                                            chunk_size, _compute_dtype(hidden, weight), label_smoothing,
                                            torch.is_grad_enabled(), weighting, anchor)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and weight.dtype in (torch.float32, torch.float64):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Computes the head's gradients in the forward, chunk by chunk, from the logits it already holds.

    The loss is a sum, so its gradients are linear in the one incoming scalar: the forward forms them for an
    incoming gradient of 1 and the backward only scales them. No logits are recomputed in the backward (one
    head matmul per chunk less than recomputing them, the largest matmul of a small model), and nothing of the
    inputs is saved: the rows' gradient takes the place of the rows. Under ``no_grad`` (evaluation) only the loss
    is computed.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_size: int, dtype: torch.dtype, smoothing: float,
                grads_wanted: bool, weighting: TokenWeighting | None, anchor: Anchor | None) -> torch.Tensor:
        need_rows, need_weight, need_bias = (grads_wanted and flag for flag in ctx.needs_input_grad[:3])
        grads = _HeadGrads(
            rows=torch.empty_like(rows) if need_rows else None,
            # Summed over the chunks in fp32 and rounded once, as the plain head's single matmul does: a bf16
            # weight (FSDP's mixed precision, DeepSpeed's bf16) would otherwise lose each chunk's share.
            weight=torch.zeros(weight.shape, dtype=_loss_dtype(weight.dtype), device=weight.device)
            if need_weight else None,
            bias=torch.zeros(weight.size(0), dtype=_loss_dtype(dtype), device=weight.device) if need_bias else None)
        total = torch.zeros((), dtype=_loss_dtype(dtype), device=rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, rows.size(0), chunk_size):
                end = min(start + chunk_size, rows.size(0))
                total += _chunk_loss_and_grads(rows[start:end], w, b, targets[start:end], dtype, smoothing,
                                               grads.chunk(start, end), weighting,
                                               anchor.rows(start, end) if anchor is not None else None)
        ctx.grads = grads
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads: _HeadGrads | None = ctx.grads
        if grads is None:
            raise RuntimeError("the chunked loss was back-propagated twice (retain_graph): its gradients are handed "
                               "over once; set loss_chunk_size: 0 for repeated backward passes")
        # Handed over once and scaled in place: the loss tensor keeps this node alive until the next micro-batch,
        # and a head-sized buffer must not live that long.
        ctx.grads = None
        scaled = [g.mul_(grad_total) if g is not None else None for g in (grads.rows, grads.weight, grads.bias)]
        grad_weight = scaled[1].to(ctx.weight_dtype) if scaled[1] is not None else None  # rounded once
        grad_bias = scaled[2].to(ctx.bias_dtype) if scaled[2] is not None else None
        return scaled[0], grad_weight, grad_bias, None, None, None, None, None, None, None


@dataclass
class _HeadGrads:
    """The head's gradients for an incoming gradient of 1, filled chunk by chunk (None: not wanted)."""

    rows: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def chunk(self, start: int, end: int) -> _HeadGrads:
        """The same buffers with the rows' gradient narrowed to one chunk (weight and bias are sums)."""
        return _HeadGrads(self.rows[start:end] if self.rows is not None else None, self.weight, self.bias)


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, as the plain path's ``logits.float()`` (fp64 stays fp64, which lets gradcheck test this)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(chunk: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Logits of one chunk in the loss dtype, computed (and rounded) in ``dtype`` as the plain head would."""
    return F.linear(chunk.to(dtype), w, b).to(_loss_dtype(dtype))


def _chunk_loss_and_grads(chunk: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                          dtype: torch.dtype, smoothing: float, grads: _HeadGrads,
                          weighting: TokenWeighting | None = None, anchor: Anchor | None = None) -> torch.Tensor:
    """Summed cross entropy of one chunk, and its share of the gradients added into ``grads``.

    The softmax is formed in place from the logits (one fp32 ``[chunk, vocab]`` tensor alive). With label
    smoothing a row's loss is ``lse - (1 - eps) * z_target - eps * mean(z)`` (the mean over the vocabulary of
    ``-log p`` is ``lse - mean(z)``) and its logits' gradient is the softmax minus ``1 - eps`` on the target and
    ``eps / V`` everywhere. The logits' gradient is rounded to ``dtype`` before both matmuls, as autocast's
    backward of ``nn.Linear`` does. A token weighting multiplies each row's loss and logits' gradient by the row's
    weight (read from the logits before the softmax overwrites them). An anchor adds ``alpha`` x each row's KL
    to the loss and ``alpha`` x ``(p sum(q) - q)`` to its logits' gradient (see the module docstring).
    """
    logits = _chunk_logits(chunk, w, b, dtype)
    picked = logits.gather(1, targets[:, None]).squeeze(1)
    spread = logits.mean(dim=1) if smoothing else None
    top = (logits.topk(min(EAFT_TOP_K, logits.size(1)), dim=1).values
           if weighting is not None and weighting.reads_logits else None)
    q = anchor.probs.to(logits.dtype) if anchor is not None else None
    q_dot_logits = (q * logits).sum(dim=1) if q is not None else None  # before the softmax overwrites the logits
    peak = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(peak).exp_()
    sums = probs.sum(dim=1)
    lse = sums.log().add_(peak.squeeze(1))
    token_loss = lse - picked if spread is None else lse - (1.0 - smoothing) * picked - smoothing * spread
    row_weights = weighting.weights(top, token_loss) if weighting is not None else None
    loss = (token_loss if row_weights is None else token_loss * row_weights).sum()
    if anchor is not None and q is not None and q_dot_logits is not None:
        loss = loss + anchor.alpha * (torch.xlogy(q, q).sum(dim=1) - q_dot_logits + lse * q.sum(dim=1)).sum()
    if grads.rows is None and grads.weight is None and grads.bias is None:
        return loss
    probs.div_(sums[:, None])
    if anchor is None or q is None:
        if smoothing:
            probs.sub_(smoothing / probs.size(1))
        probs[torch.arange(probs.size(0), device=probs.device), targets] -= 1.0 - smoothing
        if row_weights is not None:
            probs.mul_(row_weights[:, None])
    else:  # w (p - smoothed target) + alpha (p sum(q) - q), without a second [chunk, vocab] temporary
        weights = row_weights if row_weights is not None else torch.ones_like(lse)
        probs.mul_((weights + anchor.alpha * q.sum(dim=1))[:, None])
        if smoothing:
            probs.sub_((weights * (smoothing / probs.size(1)))[:, None])
        probs[torch.arange(probs.size(0), device=probs.device), targets] -= weights * (1.0 - smoothing)
        probs.sub_(q, alpha=anchor.alpha)
    grad_logits = probs.to(w.dtype)
    del logits, probs  # the fp32 copy is freed before the products when the compute dtype is narrower
    if grads.rows is not None:
        grads.rows.copy_(grad_logits @ w)
    if grads.weight is not None:
        _add_product(grads.weight, grad_logits.t(), chunk.to(w.dtype))
    if grads.bias is not None:
        grads.bias += grad_logits.sum(0, dtype=grads.bias.dtype)
    return loss


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` without an ``out``-sized temporary (the weight gradient is as large as the head: for a
    4096-wide head and a 150k vocabulary 2.5 GB in fp32, 1.2 GB in bf16)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
        return
    # A bf16 product cannot be added into fp32 in one call on every device: add it a block of rows at a time.
    for start in range(0, out.size(0), PRODUCT_BLOCK_ROWS):
        out[start:start + PRODUCT_BLOCK_ROWS] += a[start:start + PRODUCT_BLOCK_ROWS] @ b
