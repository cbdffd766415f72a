"""The OpenAI HTTP layer: protocol models, serving handlers, errors, SSE streams, the FastAPI app."""
