"""A worker rank's state: the KV and recurrent-state pools and its side of the state store."""
