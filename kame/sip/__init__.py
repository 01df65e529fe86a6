"""A small asyncio SIP stack: messages, SDP, digest auth, transactions, dialogs, RTP (docs/telephony.md)."""
