"""From a body to a finished generation: validation and preparation, tokenisation and chat templates,
structured output, the one response pipeline, incremental detokenisation."""
