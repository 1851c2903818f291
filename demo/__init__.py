"""A deterministic, vLLM-like OpenAI-compatible mock engine for tests, demos and benchmarks."""
