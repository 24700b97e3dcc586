"""Test kit: fakes of the hosted APIs and harnesses that start real engines (llama-server, vLLM,
SGLang). Used by the three test suites and the benchmarks; not shipped in the wheel."""
