"""The core model: blocks, prepared requests, annotations, conversations, the send decision."""
