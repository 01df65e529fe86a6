"""The backend: LLM clients behind one small protocol, and the planner that turns partial
transcripts into oracle updates."""
