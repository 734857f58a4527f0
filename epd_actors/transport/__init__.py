"""Byte streams under the native protocol: one framed, lock-serialized message stream per
connection."""
