"""Client APIs other than chat completions: the OpenAI Responses API, the Anthropic Messages API."""
