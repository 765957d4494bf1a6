"""One rank of the deepspeed backend's parity check: DeepSpeed Ulysses + ZeRO against the cp=1 reference.

Every rank builds the same tiny Llama and the same global batches and computes the
cp=1 reference itself (one process, whole rows, ``LocalBackend``, torch SGD).
The deepspeed side runs what ``cptune train`` runs: DeepSpeed's ``UlyssesSPAttentionHF``
around the core attention over the CP group's process group
(:func:`~cptune.parallel.backends.deepspeed_ulysses.sharding.install_ulysses_attention`),
every rank of a CP group training its slice of the group's batch
(:class:`~cptune.parallel.backends.deepspeed_ulysses.sharding.DeepSpeedUlyssesBackend`), a
DeepSpeed engine with the case's ZeRO stage (ZeRO-3 partitioning every parameter:
``stage3_param_persistence_threshold: 0``), and cptune's target count and loss scale exactly as
``CptuneTrainer`` uses them. Reported per case: step-0 loss of both paths (the deepspeed one as
the Trainer would log it), the largest relative gradient difference after DeepSpeed's
reduction, the losses of 3 optimizer steps, and under ZeRO-3 the parameters DeepSpeed left
whole on a rank (none may be); the same of the cp=1 reference computed in float64, and each
gradient's distance from it (the fp32 check of tests/parallel/test_parity.py).

Each case sets its own ``cp`` (the world splits into ``world / cp`` data-parallel groups).

A case with ``preference`` (``dpo``, ``ipo``) trains preference pairs instead (ulysses_preference_case.py).

A case with ``ring: ring-flash-attn`` (or ``torch``) runs that cptune backend under DeepSpeed's engine
instead (Axolotl's ``deepspeed: zero3.json`` next to ``context_parallel_size``): the same data path,
ring or torch attention instead of DeepSpeed's. Either way DeepSpeed is given no sequence-parallel
group and averages the gradients over all ranks, as DDP does.

Usage: ulysses_parity_worker.py OUT_DIR CASES_JSON
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from case_features import (  # tests/parallel/case_features.py, next to this script
    WINDOWED_ARCHS,
    grads_digest,
    install_case_features,
    windowed_model,
)
from float64_reference import float64_twin  # tests/parallel/float64_reference.py
from masked_eager import MASKED_EAGER, MaskedEagerBackend  # tests/parallel/masked_eager.py
from reorder_twins import (  # tests/parallel/reorder_twins.py
    TWINS,
    Twin,
    fp32_twins,
    gather_twins,
    grad_norm_rel,
    twins_of_rank,
)
from ulysses_preference_case import run_ulysses_preference_case  # tests/parallel/, beside this script

from cptune.labels import shift_labels_within_documents
from cptune.parallel.backends.attention import (
    ATTENTION_NAME,
    check_layers_served,
    count_windowed_layers,
    register_attention,
)
from cptune.parallel.backends.base import step_context
from cptune.parallel.backends.deepspeed_ulysses.patches import attention_registry_scope_patch
from cptune.parallel.backends.deepspeed_ulysses.sharding import (
    CORE_ATTENTION_NAMES,
    DeepSpeedUlyssesBackend,
    install_ulysses_attention,
)
from cptune.parallel.backends.document_attention import register_document_attention
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
from cptune.parallel.loss import count_targets, step_target_count, token_loss_sum
from cptune.parallel.router_loss import RouterBalance
from cptune.parallel.shard import TokenBatch
from cptune.patches.core import ContextParallelWith, PatchSet
from cptune.patches.deepspeed_patches import skip_shm_op_build_patch
from cptune.run.training.distributed import close_process_groups
from cptune.run.training.micro_loss import training_loss
from cptune.run.training.trainer import RouterLossLog
from devtools.tiny import (
    build_tiny_model,
    build_tiny_qwen3_moe,
    tiny_llama_config,
)
from tests import reorder
from tests.numerics import float64_loss_sum, relative_errors
from tests.parallel.zero3_partition import whole_parameters

VOCAB = 97
STEPS = 3
# SGD, as tests/parallel/parity_worker.py: the losses after each step show a gradient error as it is.
LEARNING_RATE = 0.5


def make_batch(generator: torch.Generator, case: dict) -> TokenBatch:
    """``mbs`` rows of ``seq_len`` tokens: packed (3 cuts) or one document plus end padding.

    ``long_doc`` (packed): the 3 cuts in the row's first third, so one long document fills the rest (wider
    than the windowed models' sliding window, crossing every shard boundary).
    """
    ids, labels, positions = [], [], []
    for _ in range(case["mbs"]):
        length = case["seq_len"]
        if case["packed"]:
            span = length // 3 if case.get("long_doc") else length - 1
            cuts = sorted(torch.randperm(span, generator=generator)[:3].add(1).tolist())
            docs = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        else:
            real = int(torch.randint(length // 2, length + 1, (1,), generator=generator))
            docs = [real] + ([length - real] if real < length else [])
        row_ids = torch.randint(3, VOCAB, (length,), generator=generator)
        row_labels = row_ids.clone()
        start = 0
        for i, n in enumerate(docs):
            row_labels[start : start + min(n - 1, 2)] = -100  # an untrained prompt
            if not case["packed"] and i == 1:
                row_labels[start : start + n] = -100  # the padding of an unpacked row
            start += n
        if case.get("empty_shard"):
            row_labels[: length // 2 + 1] = -100  # the first rank's slice has no target
        ids.append(row_ids)
        labels.append(row_labels)
        positions.append(torch.cat([torch.arange(n) for n in docs]))
    ids_t, labels_t, positions_t = torch.stack(ids), torch.stack(labels), torch.stack(positions)
    return TokenBatch(ids_t, positions_t, shift_labels_within_documents(labels_t, positions_t))


def build_model(case: dict, attn_implementation: str) -> torch.nn.Module:
    if case.get("arch") == "qwen3_moe":
        # 4 experts, 2 per token, router loss on (output_router_logits, router_aux_loss_coef 0.02); the experts
        # as a loop of matrix products (torch's grouped_mm takes no float64 reference).
        model = build_tiny_qwen3_moe(VOCAB, seed=1234, num_key_value_heads=case.get("kv_heads", 2))
        model.set_experts_implementation("eager")
    elif case.get("arch") in WINDOWED_ARCHS:
        model = windowed_model(case, VOCAB)
    else:
        config = tiny_llama_config(VOCAB, num_key_value_heads=case.get("kv_heads", 2))
        model = build_tiny_model(config, seed=1234)
    model.set_attn_implementation(attn_implementation)
    if case.get("qlora"):
        from quantized import quantized_4bit  # tests/parallel/quantized.py, beside this script

        model = quantized_4bit(model, attn_implementation, experts=case.get("moe_experts", False))
    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    if case.get("bf16"):
        # What DeepSpeed's engine does with ``bf16.enabled`` (engine.py, _cast_module_mixed_precision): every
        # parameter in bf16, the LoRA adapters too, the buffers (RoPE's inv_freq) left in fp32; no autocast.
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    return model


class Fp32MasterSgd:
    """SGD as DeepSpeed's bf16 engine steps (``bf16.enabled``): on fp32 master copies of the bf16 parameters,
    which then take the updated masters rounded to bf16."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float):
        self.params, self.lr = params, lr
        self.masters = [p.detach().float() for p in params]

    def step(self) -> None:
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                master.add_(param.grad.float(), alpha=-self.lr)
                param.copy_(master)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


def reference_run(
    case: dict,
    steps: list,
    float64: bool = False,
    router_aux: list[float] | None = None,
    twin: Twin | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """cp=1: every micro batch of every data-parallel group, whole rows, mean over the step's targets.

    ``float64``: the same model and loss computed in float64. A MoE model's router loss is added as
    CptuneTrainer adds it (the mean over the step's micro batches), each step's logged value (the mean
    ``aux``, a collective every rank runs) appended to ``router_aux``. ``twin``: one of the reorder
    twins of tests/parallel/reorder_twins.py instead (bf16: the reorder floor). Runs before DeepSpeed's attention
    wraps the core attention: the wrapper replaces ``sdpa`` in the registry until the case's scope
    patch reverts.
    """
    causal = case.get("causal", True)
    local = LocalBackend(causal=causal)
    if case.get("arch") == "gpt_oss":
        # transformers' eager gpt-oss attention (gpt-oss has no sdpa), the documents' masks given
        local = MaskedEagerBackend(case.get("window", 5))
    attention = reference_attention(case)
    model = build_model(case, twin.attn_implementation(attention) if twin else attention)
    loss_sum = token_loss_sum
    if float64:
        model, loss_sum = float64_twin(model), float64_loss_sum
    if twin:
        local = twin.backend(causal)
    context = twin.context if twin else contextlib.nullcontext
    router = RouterBalance.from_config(model.config)
    router_log = RouterLossLog()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = (Fp32MasterSgd if case.get("bf16") and not float64 else torch.optim.SGD)(
        trainable, lr=LEARNING_RATE
    )
    losses, step0_grads = [], {}
    for t, step in enumerate(steps):
        everything = [b for group in step for b in group]
        targets = torch.tensor(sum(int(count_targets(b.shift_labels)) for b in everything))
        total = 0.0
        # The reorder stress accumulates the fp32 reference's micro batches the other way (tests/reorder.py).
        for batch in everything if float64 else reorder.in_stress_order(everything):
            sharded = local.shard(batch)
            with context():
                outputs = model(**sharded.model_kwargs, use_cache=False)
            loss, aux = training_loss(
                loss_sum(outputs.logits, sharded.shift_labels),
                outputs,
                sharded.coords,
                step_targets=targets,
                gradient_divisor=1,
                router=router,
                accumulation=len(everything),
            )
            loss.backward()
            if aux is not None:
                router_log.add(aux)
            total += loss.item()
        if t == 0:
            step0_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        losses.append(total)
        if router is not None and router_aux is not None:
            router_aux.append(router_log.mean()["router_aux_loss"])
        optimizer.step()
        optimizer.zero_grad()
    return losses, step0_grads


def reference_attention(case: dict) -> str:
    """The cp=1 reference's attention implementation: sdpa (causal), cptune's masked SDPA (bidirectional), or
    gpt-oss's eager attention given the documents' masks (tests/parallel/masked_eager.py)."""
    if case.get("arch") == "gpt_oss":
        return MASKED_EAGER
    return "sdpa" if case.get("causal", True) else ATTENTION_NAME


def engine_grads(engine: object, ref_grads: dict) -> dict[str, torch.Tensor]:
    """The gradients the engine hands its optimizer (after DeepSpeed's reduction), shaped as the reference's."""
    from deepspeed.utils import safe_get_full_grad

    mine = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
    return {n: mine[n].reshape(g.shape) for n, g in ref_grads.items()}


def largest_relative(grads: dict, ref_grads: dict) -> tuple[float, str]:
    """The largest per-tensor max |difference| / max |reference|, and the tensor it was found in."""
    relative = {
        n: float((grads[n].float() - g.float()).abs().max() / g.float().abs().max().clamp_min(1e-30))
        for n, g in ref_grads.items()
    }
    worst = max(relative, key=relative.get)
    return relative[worst], worst


def case_result(reference: tuple, second: tuple | list, grads: dict, steps: list, run: dict) -> dict:
    """What tests/parallel/test_parity.py's ``check`` reads, from both references' ``(losses, step-0 gradients)``.

    ``second``: the cp=1 reference computed in float64, or in bf16 a list, the reorder twins' (the reorder
    floor of ``check(bf16=True)``).
    """
    ref_losses, ref_grads = reference
    grad_rel, worst = largest_relative(grads, ref_grads)
    result = {
        "ref_losses": ref_losses,
        "targets": [sum(int(count_targets(b.shift_labels)) for g in step for b in g) for step in steps],
        "grad_rel": grad_rel,
        "grad_worst": worst,
        "grad_nonzero": all(float(g.abs().max()) > 0 for g in ref_grads.values()),
        "grad_sha": grads_digest(grads),
        **run,
    }
    if isinstance(second, list):
        result["grad_norm_rel"] = grad_norm_rel(grads, ref_grads)
        result["baseline_losses"] = [losses for losses, _ in second]
        result["baseline_grad_rel"] = [largest_relative(g, ref_grads)[0] for _, g in second]
        result["baseline_grad_norm_rel"] = [grad_norm_rel(g, ref_grads) for _, g in second]
        result["twins"] = [twin.name for twin in TWINS]
    else:
        second_losses, second_grads = second
        result["ref64_losses"] = second_losses
        result["grad_errors"] = relative_errors(grads, second_grads)
        result["ref_grad_errors"] = relative_errors(ref_grads, second_grads)
    return result


def _torch_backend(case: dict, model: torch.nn.Module, cp_mesh: Any) -> object:
    from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend

    causal = case.get("causal", True)
    return TorchCpBackend(
        causal=causal, load_balance=causal, comm_strategy="allgather", cp_mesh=cp_mesh, pad_token_id=0
    )


def _ring_backend(case: dict, model: torch.nn.Module, cp_mesh: Any) -> object:
    from cptune.parallel.backends.ring_flash_attn.sharding import RingFlashAttnBackend, load_ring_flash_attn

    return RingFlashAttnBackend(
        func="varlen_llama3",
        causal=case.get("causal", True),
        heads_k_stride=1,
        cp_size=case["cp"],
        cp_rank=cp_mesh.get_local_rank(),
        group=cp_mesh.get_group(),
        pad_token_id=0,
        kernels=load_ring_flash_attn(),
    )


def _ulysses_backend(case: dict, model: torch.nn.Module, cp_mesh: Any) -> object:
    core = case.get("core", "cptune")
    # What the deepspeed backend's build does when the Trainer is built.
    install_ulysses_attention(
        model.config.get_text_config(), CORE_ATTENTION_NAMES[core], cp_mesh.get_group(), case["mbs"]
    )
    return DeepSpeedUlyssesBackend(
        core_attention=core,
        causal=case.get("causal", True),
        cp_size=case["cp"],
        cp_rank=cp_mesh.get_local_rank(),
        micro_batch_size=case["mbs"],
        pad_token_id=0,
    )


# A case's ``ring`` (a ring backend on DeepSpeed's engine; none: Ulysses) -> how this worker builds it; a name not
# here fails instead of running another backend.
BACKENDS = {None: _ulysses_backend, "ring-flash-attn": _ring_backend, "torch": _torch_backend}


def cp_backend(case: dict, model: torch.nn.Module) -> object:
    """The case's cptune backend over this rank's CP group (consecutive ranks, as accelerate's mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, cp = dist.get_world_size(), case["cp"]
    cp_mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
    return BACKENDS[case.get("ring")](case, model, cp_mesh)


def run_case(case: dict) -> dict:
    """The cp=1 reference, then the case's backend on DeepSpeed's engine: each CP group shares its batches."""
    import deepspeed

    rank, world, cp = dist.get_rank(), dist.get_world_size(), case["cp"]
    dp, dp_rank, ga, stage = world // cp, rank // cp, case["ga"], case.get("stage", 0)

    # Global batches: steps[t][dp_group][micro].
    generator = torch.Generator().manual_seed(case["seed"])
    steps = [[[make_batch(generator, case) for _ in range(ga)] for _ in range(dp)] for _ in range(STEPS)]
    ref64_router_aux: list[float] = []
    reference = reference_run(case, steps)
    if case.get("bf16"):  # the reorder floor: the same bf16 run in each twin's order
        second, twin_seconds = [], []  # CPU seconds each twin costs (issue 26: its time budget)
        for twin in TWINS:
            started = time.process_time()
            second.append(reference_run(case, steps, twin=twin))
            twin_seconds.append(time.process_time() - started)
    else:
        second = reference_run(case, steps, float64=True, router_aux=ref64_router_aux)
        # This rank's share of the reference's fp32 twins, shared after the case (gather_twins).
        candidates = fp32_twins(reference_attention(case))
        mine = {}
        for i in twins_of_rank(candidates, rank, world):
            started = time.process_time()
            losses, twin_grads = reference_run(case, steps, twin=candidates[i])
            mine[i] = {
                "name": candidates[i].name,
                "losses": losses,
                "grad_errors": relative_errors(twin_grads, second[1]),
                "seconds": time.process_time() - started,
            }
        fp32_twin_results = gather_twins(mine)
    ref_grads = reference[1]

    core = case.get("core", "cptune")
    model = build_model(case, ATTENTION_NAME if case.get("ring") else CORE_ATTENTION_NAMES[core])
    loss_fn = install_case_features(model, case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = {"stage": stage, **case.get("zero", {})}
    if stage == 3:
        # 0 partitions every parameter (the default 1e5 elements would keep all of the tiny model's whole).
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": case["mbs"],
        "gradient_accumulation_steps": ga,
        "train_batch_size": case["mbs"] * ga * world,  # DeepSpeed's data-parallel world: every rank
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    if case.get(
        "bf16"
    ):  # as `cptune train` runs bf16 under DeepSpeed: the engine casts the model (no autocast)
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(trainable, lr=LEARNING_RATE), config=config
    )
    backend = cp_backend(case, model)
    router = RouterBalance.from_config(model.config)
    # The CP group as CptuneTrainer takes it: the "cp" axis of the dp x cp mesh (consecutive ranks).
    from torch.distributed.device_mesh import init_device_mesh

    cp_group = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"].get_group()
    cp_log = RouterLossLog()
    router_aux: list[float] = []
    divisor = world  # as CptuneTrainer: DeepSpeed averages over every rank, as DDP does
    losses, grads = [], {}
    for t, step in enumerate(steps):
        micro = step[dp_rank]  # the whole batches of this rank's data-parallel group
        local_targets = sum((count_targets(b.shift_labels) for b in micro), torch.tensor(0))
        step_targets = step_target_count(local_targets, cp)  # each CP rank counted the whole batch
        logged = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro):
            with step_context(backend):  # torch's CP dispatcher, around forward and backward
                sharded = backend.shard(batch)
                loss_sum, outputs = loss_fn(engine, sharded.model_kwargs, sharded.shift_labels)
                if sharded.call is not None:  # every layer served, every windowed one with its window
                    text = engine.module.config.get_text_config()
                    check_layers_served(sharded.call, text.num_hidden_layers, count_windowed_layers(text))
                # CptuneTrainer's loss (scaled_step_loss, plus a MoE model's router loss over the CP group).
                loss, aux = training_loss(
                    loss_sum,
                    outputs,
                    sharded.coords,
                    step_targets=step_targets,
                    gradient_divisor=divisor,
                    router=router,
                    accumulation=ga,
                    cp_group=cp_group,
                )
                engine.backward(loss, scale_wrt_gas=False)
                if aux is not None:
                    cp_log.add(aux)
            logged += loss.item()  # what CptuneTrainer.training_step returns
            if t == 0 and i == ga - 1:  # DeepSpeed has reduced the step's gradients; not yet stepped
                grads = engine_grads(engine, ref_grads)
            engine.step()
        dist.all_reduce(logged)
        losses.append(float(logged) / world)  # the Trainer logs the mean over processes
        if router is not None:  # what CptuneTrainer logs as router_aux_loss (a collective)
            router_aux.append(cp_log.mean()["router_aux_loss"])
    run = {"cp_losses": losses}
    if router is not None:
        run["cp_router_aux"], run["ref64_router_aux"] = router_aux, ref64_router_aux

    if stage == 3:
        run["whole_parameters"] = whole_parameters(engine.module.named_parameters(), world)
        run["parameters"] = sum(1 for _ in engine.module.parameters())
    if case.get("bf16"):
        run["twin_seconds"] = twin_seconds
    else:
        run["fp32_twins"] = fp32_twin_results
    return case_result(reference, second, grads, steps, run)


def main() -> None:
    import deepspeed

    out_dir, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
    reorder.apply()  # CPTUNE_TEST_REORDER=1: other summation orders (tests/reorder.py)
    recipe = SimpleNamespace(context_parallel_size=2, cp_backend="deepspeed")
    with PatchSet([skip_shm_op_build_patch(ContextParallelWith(("deepspeed",)))]).applied(recipe):
        deepspeed.init_distributed(dist_backend="gloo")
    register_attention()
    register_document_attention()
    results = {}
    torch_cp = SimpleNamespace(context_parallel_size=2, cp_backend="torch")  # torch's CP on CPU (gloo)
    torch_cpu = PatchSet([torch_cp_cpu_sdpa_patch(ContextParallelWith(("torch",)))])
    for case in cases:
        # DeepSpeed's wrapper must not wrap the previous case's wrapper.
        scope = PatchSet([attention_registry_scope_patch(ContextParallelWith(("deepspeed",)))])
        with scope.applied(recipe), torch_cpu.applied(torch_cp):
            if case.get("preference"):
                results[case["name"]] = run_ulysses_preference_case(case, sys.modules[__name__])
            else:
                results[case["name"]] = run_case(case)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
