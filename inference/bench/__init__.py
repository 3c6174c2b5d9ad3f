"""The GPU benchmark: `python -m inference.bench` (what it measures and its flags: cli.py's docstring).

One module per concern:
    cli           the command line: the arguments, the rows in their order, the JSON
    model_setup   the model under test and the refusal without a CUDA GPU (scripts/bench_worker.py shares it)
    ceiling       the read bandwidth and the bytes a decode step must read: the ceiling the rows are held to
    timing        median device times, the fast runner's graph replays and its runner contract
    correctness   the --check: teacher-forced decode against the bf16 and fp32 references
    profiling     the --breakdown per kernel and the --prefill-profile
    peers         the --peers: the reference under torch.compile, transformers with a static cache
    table         the printed report
"""
