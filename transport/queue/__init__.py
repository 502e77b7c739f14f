"""The MessageQueue: one writer broadcasting to many readers over the channels of shm/ and zmq/, its
handle, and the writer's and a reader's side.
"""
