"""The results page's section on the GPU script (static text: the CPU suite does not run it).

The measurements quoted here were taken once on a lent H100 (one GPU) and are
reproduced by the commands given with them.
"""

GPU_SECTION = """\
## GPU script (not run by this suite)

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
must be a local folder or a model already in the Hugging Face cache (`python -m
benchmarks.gpu.random_model DIR` saves a Llama-3.1-8B-shaped model with random weights: memory and
speed depend on the shapes only). flash-attn must be installed, or the ring-flash-attn backends fall
back to cptune's pure-PyTorch stand-in kernels (`cptune validate` warns; see below).

### Measured on one H100 (cp=1 only)

One session was lent a single H100 80GB (torch 2.11, CUDA 13, no flash-attn; transformers 5.23,
accelerate 1.15, peft 0.21 carried as wheels). One GPU cannot run CP (NCCL takes one GPU per
process), so only the cp=1 rows were measured, on the random-weight 8B model:
`python -m benchmarks.gpu.run_gpu --base-model DIR --cp-sizes 1 --tokens-per-gpu 8192,16384 --steps 6
--warmup 2 --max-length --max-length-resolution 16384`.

| run | tokens/GPU | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak GiB |
|---|---:|---:|---:|---:|---:|
| cp=1, 8K | 8192 | 6,329 | 346 | 35.0% | 25.9 |
| cp=1, 16K | 16384 | 5,819 | 355 | 35.9% | 35.9 |

- **Longest sequence at cp=1: 49,152 tokens** train; 65,536 run out of memory.
- **Chunked loss.** Before cptune computed the loss in chunks (`cptune.parallel.loss.LOSS_CHUNK_ELEMENTS`), the same runs peaked at 29.4 and 43.2 GiB, at 6,432 and 5,866 tokens/s/GPU.
  - The longest sequence was 32,768 tokens: 49,152 failed allocating 23.48 GiB in the backward, exactly the fp32 gradient of the logits (49,152 x 128,256 x 4 B).
  - The chunked loss frees 7.3 GiB at 16K tokens and trains 1.5x longer sequences. Speed is within the run-to-run noise (-0.8%).
- **The GPU recipes' memory estimates hold.** `examples/gpu/llama31-8b-lora-ring-flash-attn-128k.yaml` estimates about 40 GB per GPU for 16,384 tokens per GPU (128K over 8).
  - The cp=1 run at 16,384 tokens peaked at 35.9 GiB = 38.5 GB. A ring rank adds only its K/V buffers (< 0.1 GB).
  - Before the chunked loss: estimated 48 GB, measured 46.4 GB.
- **The stand-in kernels are no substitute for flash-attn on a GPU:**
  `python -m benchmarks.gpu.stand_in_kernels --tokens 4096,16384` (causal, bf16, 32 query / 8 KV heads
  of 128, forward and backward) measured them 57x (4K) and 113x (16K) slower than PyTorch's fused SDPA,
  with 2.5x its peak memory (2.01 against 0.82 GiB at 16K). Outputs agree to 0.016, one bf16 step at
  these magnitudes. Install flash-attn on GPUs.
- Not measured: every cp > 1 row, ring-flash-attn with flash-attn, the torch and deepspeed backends,
  and FSDP2 on GPUs.
"""
