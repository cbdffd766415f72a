"""Ray Serve deployment, HTTP API, engine loop and CLI of tpserve."""
