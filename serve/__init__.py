"""The HTTP front door (OpenAI-compatible FastAPI app) and the offline batch script, on the one engine."""
