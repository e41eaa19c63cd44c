"""tldp: local differential privacy (TLDP) for tensor datasets on disk."""

__version__ = "0.1.0"
