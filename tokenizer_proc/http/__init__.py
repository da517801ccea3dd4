"""HTTP of the tokenizer process below the API: the connection protocol and its limits, body reading,
disconnects, server-sent events, the error type and its JSON body."""
