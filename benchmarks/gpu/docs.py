"""The results page's section on the GPU script (static text: the script has not run on this machine)."""

GPU_SECTION = """\
## GPU script (not run here)

`benchmarks/gpu/run_gpu.py` measures what the published long-context numbers measure, on one GPU node,
for a Llama-3.1-8B LoRA recipe (`benchmarks/gpu/llama31_8b_lora.yaml`: LoRA r=16 on every linear
layer, bf16, gradient checkpointing, micro batch 1, unpacked rows of one causal document):

```bash
python -m benchmarks.gpu.run_gpu --base-model /models/Llama-3.1-8B --cp-sizes 1,2,4,8 \\
    --tokens-per-gpu 8192,16384 --max-length --out outputs/gpu-bench
python -m benchmarks.gpu.run_gpu --dry-run      # the runs and recipes, nothing launched
```

Every run goes through cptune's `train()` in `cp` processes (dp=1), timed by the same step probe as
the CPU suite, and reports per backend (discovered from the recipe schema, as in section 5) and cp size:

- **tokens/s/GPU** = sequence length / step time / cp;
- **MFU** = tokens/s/GPU x (6P + 6·L·h·S) / peak (989 TFLOP/s bf16 dense for H100/H200; `--peak-tflops`):
  attention FLOPs counted, causal halved, recomputation not counted, 6P kept for LoRA as published
  MFU figures do (`benchmarks/gpu/flops.py`; for Llama-3.1-8B at 32K it reproduces torchtitan's
  ~288 TFLOP/s from 3,890 tokens/s/GPU);
- **weak-scaling efficiency** = MFU at cp=N / MFU at cp=1 with the same tokens per GPU (ideal: 1.0);
  at 8K tokens per GPU this is the end-to-end counterpart of ring-flash-attn's kernel-level
  "zigzag ≈ 90% of ideal flash-attn" (8xH800, 8K tokens/GPU);
- **peak memory** per GPU (`torch.cuda.max_memory_allocated`, largest rank);
- with `--max-length`, the **longest sequence that trains** per backend and cp (doubling until a run
  runs out of memory, then bisecting to 8K tokens), to compare with Axolotl's Llama-3.1-8B QLoRA
  129,024 tokens on 8xH100 without gradient checkpointing (`--no-gradient-checkpointing`; cptune
  loads the base weights in bf16, not 4-bit, so its weights take ~16 GB instead of ~5.5 GB per GPU).

Results go to `OUT/gpu_results.json` and `OUT/gpu_results.md`. The runs are offline: `--base-model`
must be a local folder or a model already in the Hugging Face cache. flash-attn must be installed,
or the ring-flash-attn backends fall back to cptune's slow CPU-style kernels (cptune warns).
"""
