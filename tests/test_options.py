import pytest
import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.options import DEFAULT_CUDAGRAPH_SIZES, DEFAULT_SPLITTING_OPS, parse_options

from .nets import MLP


def test_defaults():
    opts = parse_options(None)
    assert opts.compile_sizes == ()
    assert opts.splitting_ops == DEFAULT_SPLITTING_OPS
    assert opts.compiler == "inductor" and opts.compile_mode == "eager"
    assert opts.cudagraph_sizes[:4] == (1, 2, 4, 8) and opts.cudagraph_sizes[-1] == 256
    assert len(DEFAULT_CUDAGRAPH_SIZES) == 3 + 32  # 1, 2, 4 and 8..256 step 8


def test_store_frozen_values_and_where_each_builds():
    assert parse_options(None).frozen_store_mode() == "worker"  # the default: True
    assert parse_options({"store_frozen": "inline"}).frozen_store_mode() == "inline"
    assert parse_options({"store_frozen": "worker"}).frozen_store_mode() == "worker"
    assert parse_options({"store_frozen": False}).frozen_store_mode() is None
    assert parse_options(None).prune_autotune is True


def test_dict_and_string_forms_agree():
    from_dict = parse_options({"compile_sizes": [8, 1, 4, 2, 4], "compiler": "eager"})
    from_str = parse_options("{'compile_sizes': [8, 1, 4, 2, 4], 'compiler': 'eager',}")
    assert from_dict == from_str
    assert from_dict.compile_sizes == (1, 2, 4, 8)  # sorted, de-duplicated
    assert isinstance(sb.SizeBackendOptions(), sb.SizeBackendOptions)


def test_seed_string_with_expanded_sequence():
    # The seed's usage 3: "{'candidate_compile_sizes': [$(seq -s, 1 5)]}" expands to this.
    assert parse_options("{'compile_sizes': [1,2,3,4,5]}").compile_sizes == (1, 2, 3, 4, 5)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"compile_size": [1]}, r"unknown option 'compile_size'; did you mean 'compile_sizes'"),
        ({"splitting_op": []}, r"did you mean 'splitting_ops'"),
        ({"compile_sizes": 4}, r"'compile_sizes'.*got 4"),
        ({"compile_sizes": [0, 2]}, r"'compile_sizes'.*0 is not.*got \[0, 2\]"),
        ({"compile_sizes": [-1]}, r"'compile_sizes'.*-1 is not"),
        ({"compile_sizes": [True, 2]}, r"'compile_sizes'.*True is not"),
        ({"compile_sizes": [2.0]}, r"'compile_sizes'.*2.0 is not"),
        ({"compile_sizes": ["4"]}, r"'compile_sizes'.*'4' is not"),
        ({"compile_sizes": [10**9]}, r"'compile_sizes'.*larger than the maximum"),
        ({"batch_dim": 0}, r"'batch_dim'.*got 0"),
        ({"batch_dim": [0]}, r"'batch_dim'.*got \[0\]"),
        ({"batch_dim": [0, -1]}, r"'batch_dim'.*got \[0, -1\]"),
        ({"compiler": "tvm"}, r"'compiler'.*got 'tvm'"),
        ({"compile_mode": "sometimes"}, r"'compile_mode'.*got 'sometimes'"),
        ({"cudagraphs": 1}, r"'cudagraphs'.*True or False.*got 1"),
        ({"pad_to_size": "yes"}, r"'pad_to_size'.*got 'yes'"),
        ({"strict": None}, r"'strict'.*got None"),
        ({"splitting_ops": "aten::mm"}, r"'splitting_ops'.*list of op names"),
        ({"splitting_ops": [3]}, r"'splitting_ops'.*3 is not"),
        ({"inductor_options": [1]}, r"'inductor_options'"),
        ({"cache_dir": 5}, r"'cache_dir'.*got 5"),
        ({"cudagraph_warmups": -1}, r"'cudagraph_warmups'.*got -1"),
        # A capture must follow at least one plain run of the shape (issue 12).
        ({"cudagraph_warmups": 0}, r"'cudagraph_warmups'.*>= 1.*got 0"),
        ({"cudagraphs": True, "compile_mode": "background"},
         r"'compile_mode'.*'background'.*cudagraphs=True"),
        ([1, 2], r"must be a dict.*list"),
        (7, r"must be a dict.*int"),
        ("compile_sizes=[1]", r"not a Python dict literal"),
        ("{'compile_sizes': [1, 2}", r"not a Python dict literal"),
        ("__import__('os').getcwd()", r"not a Python dict literal"),
        ("[1, 2]", r"must be a dict.*list"),
        ("{{'compile_sizes': [1]}}", r"not a Python dict literal"),  # a set of a dict
        ("{'compile_sizes': [1]} junk", r"not a Python dict literal"),
        ("[" * 1000 + "]" * 1000, r"not a Python dict literal"),
        ({"compile_sizes": [[1]]}, r"'compile_sizes'.*\[1\] is not"),
        ({"compile_sizes": {1, 2}}, r"'compile_sizes'.*list of positive ints"),
        ({"batch_dim": [True, 0]}, r"'batch_dim'.*got \[True, 0\]"),
        ({"cudagraph_warmups": True}, r"'cudagraph_warmups'.*got True"),
        ({"compiler": None}, r"'compiler'.*got None"),
        ({None: 1}, r"unknown option None"),
        ({"inductor_options": {"max_autotun": True}}, r"'inductor_options'.*'max_autotun'.*no such"),
        ({"inductor_options": {"max_autotune": "yes"}}, r"'inductor_options'.*'max_autotune'.*bool"),
        ({"inductor_options": {1: 2}}, r"'inductor_options'.*str keys"),
        ({"direct_calls": 1}, r"'direct_calls'.*True or False.*got 1"),
        ({"store_frozen": 1}, r"'store_frozen'.*True, False, 'worker' or 'inline'.*got 1"),
        ({"store_frozen": "workers"}, r"'store_frozen'.*got 'workers'"),
        ({"store_frozen": None}, r"'store_frozen'.*got None"),
        ({"prune_autotune": "no"}, r"'prune_autotune'.*True or False"),
    ],
)
def test_bad_options_name_key_and_value(options, match):
    with pytest.raises(ValueError, match=match):
        parse_options(options)


def test_bad_option_reaches_torch_compile_caller_as_value_error():
    model = MLP()
    compiled = torch.compile(model, backend="sizebackend", options={"compile_sizes": [0]})
    with pytest.raises(ValueError, match=r"'compile_sizes'.*got \[0\]"):
        compiled(torch.randn(3, 16))


def test_unknown_splitting_op_is_an_error_at_first_compile():
    compiled = torch.compile(MLP(), backend="sizebackend", options={"splitting_ops": ["aten::no_such_op"]})
    with pytest.raises(ValueError, match=r"'splitting_ops'.*aten::no_such_op"):
        compiled(torch.randn(3, 16))


def test_torch_compile_mode_is_rejected():
    compiled = torch.compile(MLP(), backend="sizebackend", mode="max-autotune")
    with pytest.raises(ValueError, match=r"mode='max-autotune'"):
        compiled(torch.randn(3, 16))


def test_batch_dim_out_of_range_is_an_error():
    compiled = torch.compile(MLP(), backend="sizebackend", dynamic=True,
                             options={"batch_dim": [3, 0], "compiler": "eager"})
    with pytest.raises(ValueError, match=r"'batch_dim'.*input index 3"):
        compiled(torch.randn(3, 16))


def test_cudagraphs_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    compiled = torch.compile(MLP(), backend="sizebackend", options={"cudagraphs": True})
    with pytest.raises(ValueError, match=r"'cudagraphs'.*no.*CUDA|'cudagraphs'.*CUDA"):
        compiled(torch.randn(3, 16))


def test_inductor_options_accept_torch_compile_spellings():
    opts = parse_options({"inductor_options": {"max-autotune": False, "triton.cudagraphs": False}})
    assert opts.inductor_options == {"max_autotune": False, "triton.cudagraphs": False}


@pytest.mark.parametrize(
    "options, match",
    [
        ("compile_sizes: [1, 2]", r"not a Python dict literal"),
        ("{'compile_sizes': [1, 2]", r"not a Python dict literal"),
        ({"compile_sizes": [1, [2]]}, r"'compile_sizes'.*\[2\] is not"),
        ({"compile_sizes": [1 << 40]}, r"'compile_sizes'.*larger than the maximum"),
        ({"compile_sizes": [-2]}, r"'compile_sizes'.*-2 is not"),
        ({"compile_sizes": [False]}, r"'compile_sizes'.*False is not"),
        ({"compiler": "tvm"}, r"'compiler'.*got 'tvm'"),
        ({"inductor_options": {"no_such_entry": 1}}, r"'inductor_options'.*'no_such_entry'"),
        ({"cudagraph_warmups": True}, r"'cudagraph_warmups'.*got True"),
    ],
)
def test_malformed_options_fail_the_first_compile_with_a_value_error(options, match):
    # torch.compile itself accepts anything; the first call hands the graph to the
    # backend, which names the key and the value (no wrapping BackendCompilerFailed).
    compiled = torch.compile(MLP(), backend="sizebackend", options=options)
    with pytest.raises(ValueError, match=match) as info:
        compiled(torch.randn(3, 16))
    assert type(info.value).__module__ == "dynamo_sizebackend.options"


def test_check_options_fails_at_startup_with_the_first_call_error():
    opts = sb.check_options("{'compile_sizes': [4, 2], 'compiler': 'eager'}")
    assert opts.compile_sizes == (2, 4)
    with pytest.raises(ValueError, match=r"unknown option 'compile_size'"):
        sb.check_options({"compile_size": [1]})
    # The checked object goes to torch.compile as it is.
    compiled = torch.compile(MLP(), backend="sizebackend", dynamic=True, options=opts)
    with sb.expect(graphs=1, calls={"2": 1}):
        compiled(torch.randn(2, 16))


def test_check_options_refuses_cudagraphs_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"'cudagraphs'.*CUDA device"):
        sb.check_options({"cudagraphs": True})
    assert not sb.parse_options({"cudagraphs": True}).compile_sizes  # no device check there


@pytest.mark.parametrize(
    "mode, match",
    [
        ("reduce-overhead", r"mode='reduce-overhead'.*options=\{'cudagraphs': True\}"),
        ("max-autotune", r"mode='max-autotune'.*'inductor_options'"),
    ],
)
def test_check_options_names_the_option_for_a_torch_compile_mode(mode, match):
    with pytest.raises(ValueError, match=match):
        sb.check_options({}, mode=mode)
    assert sb.check_options({}, mode="default") == sb.SizeBackendOptions()


def test_reduce_overhead_through_torch_compile_points_to_cudagraphs():
    compiled = torch.compile(MLP(), backend="sizebackend", mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"cudagraphs"):
        compiled(torch.randn(3, 16))


@pytest.mark.parametrize("key", ["inductor_options", "sized_inductor_options"])
def test_inductor_patches_with_the_eager_compiler_are_an_error(key):
    with pytest.raises(ValueError, match=rf"'{key}'.*no effect with compiler='eager'"):
        parse_options({"compiler": "eager", key: {"max_autotune": True}})
    parse_options({"compiler": "eager", key: {}})  # empty: nothing dropped


def test_process_default_of_sized_patches_is_no_error_with_eager(monkeypatch):
    from dynamo_sizebackend import options as options_module

    monkeypatch.setenv("SIZEBACKEND_SIZED_INDUCTOR_OPTIONS", "{'max_autotune': True}")
    opts = options_module.SizeBackendOptions(compiler="eager")
    assert opts.sized_inductor_options == {"max_autotune": True}
