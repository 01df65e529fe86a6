"""OpenAI's GPT-Live protocol (`/v1/live/sessions`) as a transport over one TandemSession (docs/live.md)."""
