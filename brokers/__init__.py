"""Broker backends behind one interface (:mod:`duebox.brokers.base`)."""

from .base import Broker, BrokerContext, Capabilities, Delivery, Outgoing, PublishResult

__all__ = ["Broker", "BrokerContext", "Capabilities", "Delivery", "Outgoing", "PublishResult"]
