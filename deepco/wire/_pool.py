"""The descriptor pool that DeepCo's generated protobuf code registers its messages in.

Not protobuf's default pool: the Open Inference Protocol's messages are called ``inference.*`` in every
implementation, and tritonclient registers its own copies of them in the default pool. Two different
files defining ``inference.ServerLiveRequest`` in one pool is a hard error at import time, so a private
pool is what lets the device, tests and users import ``deepco.wire`` and ``tritonclient`` in one process.
The wire format does not involve the pool at all. protos/generate.py points the generated code here.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
