"""Building blocks of ``python -m srt.bench_serving``.

``metrics``  pure arithmetic: per-request TTFT/ITL/TPOT/E2E from chunk arrival times, the
             aggregate ``BenchmarkMetrics``, SGLang's result block (format and parse).
``datasets`` seeded workloads: random, random-ids, sharegpt (local file), generated-shared-prefix;
             ``get_dataset`` picks one from the parsed flags.
``backends`` one streaming request function per HTTP API (srt/sglang native, OpenAI completions, chat).
``tokenizer`` the client's tokenizer (a directory, hub name or .gguf file; GGUF ones cached as folders).
``plot``     CDFs and throughput over time (matplotlib, Agg).
"""
