"""The benchmark lab beside the runtime: methods (our decoders, HF baselines, peer engines), the harness that runs
them on the same prompts, MT-bench reading, reports, tables and plots. It imports the runtime; the runtime never
imports it.

- ``methods``: what a benchmark compares (``HFBaseline``, ``DecoderMethod``, ``PeerMethod``) and their checks;
- ``harness``: ``run_benchmark`` (batch 1) and ``run_batch_benchmark`` (throughput at batch sizes);
- ``hf``: transformers' ``generate`` as the baselines run it; ``peers``: other projects' decoders;
- ``report``: per-method stats, summaries, markdown tables, histograms; ``divergence``: why an output differs from
  HF greedy (``rescore`` for a finished results file);
- ``prompts``: MT-bench and JSONL prompt files; ``timing``: the micro-benchmarks' timing and the run's environment.
"""
