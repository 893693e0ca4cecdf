"""`omniwalk bench`: load generator, metrics and in-process baselines.

    workload.py     seeded synthetic or file prompts (token ids), output lengths, arrival gaps
    backends.py     in-process Engine, or any server's streaming /v1/completions; one record per request
    runner.py       one phase: closed loop at c, or Poisson at r (optionally capped), with progress
    client_processes.py  the load generator's CPU (`load_generator`) and `--client-processes N`: one phase
                    spread over N processes, records merged
    metrics.py      TTFT, TPOT, ITL (per token and per chunk), E2E, throughput, failures
    report.py       summary table, failure banner, machine info, JSON
    hf_baseline.py  the same prompts through transformers `generate` (eager, static cache + compile)
    cli.py          the `omniwalk bench` flags and run
    tts.py          `omniwalk bench --tts`: speech workload and run (flags, JSON)
    tts_backends.py in-process Engine.submit(SpeechRequest), or /v1/audio/speech with stream_format=sse
    tts_metrics.py  time to first audio, RTF, audio throughput, streaming viability, failures
"""
