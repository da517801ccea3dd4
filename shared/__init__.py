"""Code every hyssm process imports: config, messages, channels, logging. Never imports torch."""
