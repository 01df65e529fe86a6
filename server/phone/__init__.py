"""Phone calls: a carrier's media stream (Twilio, Telnyx, Vonage) as one more link and mapping on the session
runner, around a GPT-Live session (docs/telephony.md)."""
