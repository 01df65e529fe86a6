"""SIP calls into KAME: the SIP endpoint, OpenAI's call control and webhooks (docs/telephony.md)."""
