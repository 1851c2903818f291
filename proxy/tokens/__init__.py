"""Token ids an engine did not return, and where they come from: the engine's own
tokenizer over HTTP, a local tokenizer (GGUF or tokenizer.json, with its chat template),
and the prompt ids decoded in the new tokens only.

Owns: `resolve`, `engine_tokenizer`, `local_tokenizer`, `gguf_metadata`, `gguf_tokenizer`,
`chat_template`, `prompt_prefix`.
May import: `http`, `upstream`, `apis`.
"""
