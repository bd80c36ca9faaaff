"""Rollouts: prompts in, sampled tokens with the generator's fp32 logprobs out.

    types.py      EngineConfig and the prompt checks (no engine imported); a request's SamplingParams and
                  the Rollout it returns: rlalign.sampling_params, rlalign.sequences (shared with training/)
    sampling.py   the one sampling step of both engines (token + logprob from logits)
    native/       the reference engine: scheduler, KV pages, CUDA-graph runner, engine
    vllm/         vLLM schedules, rlalign computes (imported only when generator.backend=vllm)
    generator.py  the Generator protocol both engines implement, and the one factory
"""
