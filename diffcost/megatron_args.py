"""Read a model and a plan from a Megatron-LM command line.

Only the flags that shape the model and the plan are read; every other flag is ignored and
reported. Unknown values of the flags we read raise a ``ValueError`` naming the flag.
"""

from __future__ import annotations

import shlex

from diffcost.specs import ModelSpec, MoeSpec, PlanSpec

_VALUE_FLAGS = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--context-parallel-size": "cp",
    "--expert-model-parallel-size": "ep",
    "--num-layers-per-virtual-pipeline-stage": "layers_per_virtual_stage",
    "--virtual-pipeline-model-parallel-size": "chunks",
    "--micro-batch-size": "microbatch",
    "--global-batch-size": "global_batch",
    "--recompute-granularity": "recompute",
    "--recompute-method": "recompute_method",
    "--recompute-num-layers": "recompute_num_layers",
    "--cpu-offloading-num-layers": "offload_layers",
    "--num-layers": "n_layers",
    "--hidden-size": "hidden",
    "--ffn-hidden-size": "ffn_hidden",
    "--num-attention-heads": "heads",
    "--num-query-groups": "kv_heads",
    "--seq-length": "seq_len",
    "--vocab-size": "vocab",
    "--padded-vocab-size": "vocab",
    "--normalization": "norm",
    "--num-experts": "experts",
    "--moe-router-topk": "top_k",
    "--moe-expert-capacity-factor": "capacity_factor",
    "--fp8-format": "fp8",
    "--hidden-dropout": "hidden_dropout",
    "--attention-dropout": "attention_dropout",
}
_SWITCH_FLAGS = {
    "--sequence-parallel": "sp",
    "--use-distributed-optimizer": "dist_opt",
    "--recompute-activations": "recompute_selective",
    "--cpu-offloading": "cpu_offloading",
    "--swiglu": "swiglu",
    "--untie-embeddings-and-output-weights": "untied",
    "--disable-bias-linear": "no_bias",
    "--bf16": "bf16",
    "--fp16": "fp16",
    "--overlap-grad-reduce": "overlap_dp",
    "--tp-comm-overlap": "overlap_tp",
    "--accumulate-allreduce-grads-in-fp32": "fp32_grads",
    "--grad-reduce-in-bf16": "bf16_grads",
    "--use-flash-attn": "flash",
    "--group-query-attention": "gqa",
}
GPT2_VOCAB = 50257


def parse_megatron_args(
    text: str, n_gpus: int, name: str = "megatron"
) -> tuple[ModelSpec, PlanSpec, list[str]]:
    """(model, plan, ignored flags) from a Megatron-LM argument string.

    Args:
        text: the arguments, e.g. ``"--num-layers 24 --hidden-size 2048 ..."``.
        n_gpus: GPUs of the job; the data-parallel size is ``n_gpus / (tp * pp * cp)``.

    Raises:
        ValueError: a required flag is missing, a value is malformed, or the GPU count is not
            divisible by ``tp * pp * cp``.
    """
    flags = _Flags.parse(text)
    model = _model(flags, name)
    return model, _plan(flags, model, n_gpus), flags.ignored


class _Flags:
    """The flags of one argument string: values by key, switches, and flags not understood."""

    def __init__(self, values: dict[str, str], switches: set[str], ignored: list[str]):
        self.values, self.switches, self.ignored = values, switches, ignored

    @classmethod
    def parse(cls, text: str) -> _Flags:
        tokens = shlex.split(text)
        flags = cls({}, set(), [])
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            flag, eq, inline = tok.partition("=")
            if flag in _VALUE_FLAGS:
                if eq:
                    flags.values[_VALUE_FLAGS[flag]] = inline
                elif i + 1 < len(tokens):
                    flags.values[_VALUE_FLAGS[flag]] = tokens[i + 1]
                    i += 1
                else:
                    raise ValueError(f"{flag} needs a value")
            elif flag in _SWITCH_FLAGS:
                flags.switches.add(_SWITCH_FLAGS[flag])
            elif tok.startswith("--"):
                flags.ignored.append(tok)
            i += 1
        return flags

    def num(self, key: str, default=None, cast=int):
        """The number given for ``key``, else ``default`` (None: the flag is required)."""
        if key not in self.values:
            if default is None:
                flag = next(f for f, k in _VALUE_FLAGS.items() if k == key)
                raise ValueError(f"missing {flag}: needed to describe the model")
            return default
        try:
            return cast(self.values[key])
        except ValueError:
            flag = next(f for f, k in _VALUE_FLAGS.items() if k == key)
            raise ValueError(f"{flag} {self.values[key]!r} is not a number") from None


def _model(flags: _Flags, name: str) -> ModelSpec:
    num, switches, values = flags.num, flags.switches, flags.values
    n_layers, hidden, heads = num("n_layers"), num("hidden"), num("heads")
    swiglu = "swiglu" in switches
    kv = num("kv_heads", heads) if "gqa" in switches or "kv_heads" in values else heads
    ffn_default = int(8 * hidden / 3 / 64 + 0.999) * 64 if swiglu else 4 * hidden
    experts = num("experts", 1)
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden=hidden,
        ffn_hidden=num("ffn_hidden", ffn_default),
        heads=heads,
        kv_heads=kv,
        seq_len=num("seq_len"),
        vocab=num("vocab", GPT2_VOCAB),
        mlp="swiglu" if swiglu else "gelu",
        norm="rmsnorm" if values.get("norm", "").lower() == "rmsnorm" else "layernorm",
        tied_embeddings="untied" not in switches,
        bias="no_bias" not in switches,
        precision="fp8" if "fp8" in values else ("fp16" if "fp16" in switches else "bf16"),
        moe=MoeSpec(experts, num("top_k", 2), num("capacity_factor", 1.0, float))
        if experts > 1
        else None,
        # Megatron-Core runs TE's cuDNN attention unless told to use the flash-attn package.
        attention="flash" if "flash" in switches else "cudnn",
        # Megatron's dropout defaults are 0.1; masks are kept unless both rates are 0
        dropout=any(num(k, 0.1, float) > 0 for k in ("hidden_dropout", "attention_dropout")),
    )


def _plan(flags: _Flags, model: ModelSpec, n_gpus: int) -> PlanSpec:
    num, switches, values = flags.num, flags.switches, flags.values
    tp, pp, cp, ep = num("tp", 1), num("pp", 1), num("cp", 1), num("ep", 1)
    if n_gpus % (tp * pp * cp):
        raise ValueError(
            f"--gpus {n_gpus} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}"
        )
    chunks = num("chunks", 1)
    if "layers_per_virtual_stage" in values:
        per = num("layers_per_virtual_stage")
        chunks = max(1, model.n_layers // (pp * per))
    recompute = values.get(
        "recompute", "selective" if "recompute_selective" in switches else "none"
    )
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"--recompute-granularity {recompute!r}: expected full or selective")
    mb = num("microbatch", 1)
    dp = n_gpus // (tp * pp * cp)
    # Full recompute by "block" checkpoints the first N layers of each (virtual) stage only;
    # "uniform" (the default) checkpoints every layer, N at a time.
    share = 1.0
    if recompute == "full" and values.get("recompute_method") == "block":
        share = min(1.0, num("recompute_num_layers", 1) * pp * chunks / model.n_layers)
        if share <= 0.0:  # no layer checkpointed
            recompute, share = "none", 1.0
    offload = _offload_fraction(flags, model, pp, recompute)
    return PlanSpec(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        sequence_parallel="sp" in switches,
        zero=1 if "dist_opt" in switches else 0,
        recompute=recompute,
        recompute_fraction=share,
        offload_fraction=offload,
        microbatch=mb,
        global_batch=num("global_batch", mb * dp),
        schedule="interleaved" if chunks > 1 else "1f1b",
        chunks=chunks,
        overlap_dp="overlap_dp" in switches,
        overlap_tp="overlap_tp" in switches,
        # Megatron accumulates and reduces gradients in fp32 with --bf16 (it forces
        # --accumulate-allreduce-grads-in-fp32), in fp16 with --fp16 unless asked for fp32.
        grad_reduce_fp32=(model.precision != "fp16" or "fp32_grads" in switches)
        and "bf16_grads" not in switches,
    )


def _offload_fraction(flags: _Flags, model: ModelSpec, pp: int, recompute: str) -> float:
    """Share of the layers whose activations go to host memory (``PlanSpec.offload_fraction``).

    Megatron-LM's ``validate_args`` (megatron/training/arguments.py) turns ``--cpu-offloading``
    on when ``--cpu-offloading-num-layers`` (default 0) is positive; ``--cpu-offloading`` alone
    offloads 0 layers. Megatron-Core's ``TransformerConfig.__post_init__``
    (megatron/core/transformer/transformer_config.py) then requires ``0 <= N < num_layers``,
    one pipeline stage and no activation recompute; the same errors are raised here.
    """
    layers = flags.num("offload_layers", 0)
    if layers <= 0 and "cpu_offloading" not in flags.switches:
        return 0.0
    if not 0 <= layers < model.n_layers:
        raise ValueError(
            f"--cpu-offloading-num-layers {layers}: Megatron-Core offloads 0 to "
            f"{model.n_layers - 1} of the {model.n_layers} layers"
        )
    if pp > 1:
        raise ValueError(
            f"--cpu-offloading with --pipeline-model-parallel-size {pp}: Megatron-Core supports "
            "CPU offloading with one pipeline stage only"
        )
    if recompute != "none":
        raise ValueError(
            f"--cpu-offloading with recompute {recompute!r}: Megatron-Core does not combine "
            "CPU offloading with activation recomputation"
        )
    return layers / model.n_layers
