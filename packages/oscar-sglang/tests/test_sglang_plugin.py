import importlib.util

from oscar_math.plugin_checks import contract_tests

ENGINE_PRESENT = importlib.util.find_spec("sglang") is not None

# the plugin contract (oscar_math.plugin_checks): names its engine without importing it, listed
test_plugin_module, test_engine_listed = contract_tests("sglang", "oscar-sglang", "oscar_sglang.plugin")
