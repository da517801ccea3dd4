"""The API surfaces: SGLang's native /generate, the OpenAI endpoints, /tokenize, /health, what sglang-
router asks; their schemas, response formats, logprobs and tool calls."""
