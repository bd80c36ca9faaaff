"""The native engine (the reference generator, and the CPU default): continuous batching over a
paged KV cache, on the same model and ops as the trainer.

    scheduler.py  which rows run each step (decode rows first, then prompt chunks), slots and pages
    episodes.py   multi-turn episodes: a sequence paused between turns, its observation prefilled onto it
    pages.py      the KV cache and block table kept between calls (KVState)
    graphs.py     CUDA graphs of steps run row by row: decode steps, small steps with prompt chunks (DecodeGraphs)
    runner.py     one step on the model: inputs to the device, forward, sampling (ModelRunner)
    engine.py     NativeEngine: schedule -> run -> postprocess, until every request is done
"""
