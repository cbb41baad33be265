"""Transports: how bytes travel between two ranks. See base.py for the interface."""

from nanoparallel.transport.base import Recv, Send, Transport

__all__ = ["Recv", "Send", "Transport"]
