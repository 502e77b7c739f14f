"""Security: the secret policy (which secret, and whether TCP may go without one), the ZAP handler
that vets CURVE peers at runtime, and the sealing of queue messages (AES-GCM). Policy apart from runtime,
as pyzmq's zmq.auth does.
"""
