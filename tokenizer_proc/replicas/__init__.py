"""Where a request goes: the client of one scheduler, and with --dp-size the backend over several
replicas and its routing rule."""
