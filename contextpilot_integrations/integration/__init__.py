"""What the framework adapters call: the micro-batcher, the pilot an integration makes on its own,
and the cache plan and usage of a hosted provider for one bound call. Above the pilot and the engines."""
