"""epd_actors: a Trio-native router for Encode/Prefill/Decode disaggregated LLM serving."""

__version__ = "0.1.0"
