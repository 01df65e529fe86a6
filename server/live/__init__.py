"""OpenAI's GPT-Live protocol (`/v1/live/sessions`) as a transport over one TandemSession: issue
#26, being built. So far: the user's transcript as append-only deltas (`stable_text`)."""
