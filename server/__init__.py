"""The KAME FastAPI websocket server: many tandem sessions on one batched front-end engine."""
