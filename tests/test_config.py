"""Run configuration: YAML, --set overrides and validation (``dpscale account``: test_config_account.py)."""

import pytest
import yaml

from dpscale.config import Config, DPConfig, load_config, parse_override, save_config, validate
from dpscale.errors import ConfigError
from dpscale.models import build_model, count_parameters

# --- defaults and loading -----------------------------------------------------------------


def test_defaults_validate():
    config = load_config()
    assert config == Config()
    validate(config)
    assert config.dp.epsilon == 3.0 and config.dp.delta == 1e-5
    assert config.dp.noise_multiplier is None and config.dp.max_grad_norm == 1.0
    assert config.dp.sampling == "poisson" and config.dp.accountant == "pld"
    assert config.model.name == "papernot-cnn"
    assert config.optim.betas == (0.9, 0.999)


def _write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_file_sets_values_and_keeps_other_defaults(tmp_path):
    path = _write(
        tmp_path,
        """
dp:
  epsilon: 8
  batch_size: 1024
  accountant: rdp
optim:
  name: sgd
  lr: 2
  momentum: 0.9
  nesterov: true
  betas: [0.8, 0.95]
model:
  name: tramer-cifar-cnn
  activation: tempered_sigmoid(s=2,T=2,o=1)
  kwargs:
    hidden: 64
train:
  epochs: null
  steps: 500
run:
""",
    )
    config = load_config(path)
    assert config.dp.epsilon == 8.0 and isinstance(config.dp.epsilon, float)
    assert config.dp.batch_size == 1024 and config.dp.accountant == "rdp"
    assert config.dp.delta == DPConfig().delta  # untouched key keeps its default
    assert config.optim.lr == 2.0 and isinstance(config.optim.lr, float)
    assert config.optim.nesterov is True
    assert config.optim.betas == (0.8, 0.95)
    assert config.model.activation == "tempered_sigmoid(s=2,T=2,o=1)"
    assert config.model.kwargs == {"hidden": 64}
    assert config.train.epochs is None and config.train.steps == 500
    assert config.run == Config().run  # empty section -> defaults
    assert config.data == Config().data  # missing section -> defaults
    load_config(str(path))  # str paths work too


def test_empty_yaml_file_is_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()


def test_overrides(tmp_path):
    path = _write(tmp_path, "dp:\n  epsilon: 2.0\n  noise_multiplier: 1.0\n")
    config = load_config(
        path,
        [
            "dp.epsilon=1.5",
            "optim.lr=4",
            "model.kwargs={filters: [8, 8]}",
            "dp.noise_multiplier=null",
            "optim.betas=[0.5, 0.6]",
            "run.device = cuda",
        ],
    )
    assert config.dp.epsilon == 1.5  # --set wins over the file
    assert config.optim.lr == 4.0 and type(config.optim.lr) is float
    assert config.model.kwargs == {"filters": [8, 8]}
    assert config.dp.noise_multiplier is None  # null overrides the file's 1.0
    assert config.optim.betas == (0.5, 0.6) and isinstance(config.optim.betas, tuple)
    assert config.run.device == "cuda"
    # The kwargs reach the model builder: Papernot CNN with k = 8 has
    # (8*64+8) + (8*8*16+8) + (8*16*32+32) + (32*10+10) = 6,010 parameters.
    model = build_model(config.model.name, 10, (1, 28, 28), **config.model.kwargs)
    assert count_parameters(model) == 6_010


def test_later_override_wins():
    assert load_config(overrides=["dp.epsilon=1", "dp.epsilon=7"]).dp.epsilon == 7.0


def test_empty_override_value_is_null():
    config = load_config(overrides=["dp.epsilon=", "dp.noise_multiplier=1.0"])
    assert config.dp.epsilon is None and config.dp.noise_multiplier == 1.0


def test_parse_override():
    keys, value = parse_override("a.b.c=[1, 2]")
    assert keys == ["a", "b", "c"] and value.parsed == [1, 2] and value.raw == "[1, 2]"
    assert parse_override("dp.epsilon=null")[1].parsed is None
    assert parse_override("x=a=b")[1].raw == "a=b"


@pytest.mark.parametrize("text", ["runs/a #2", "2024", "yes", "null-run", "runs/x: y"])
def test_string_keys_take_the_text_as_typed(text):
    assert load_config(overrides=[f"run.out_dir={text}"]).run.out_dir == text
    assert load_config(overrides=["run.out_dir=null"]).run.out_dir is None


def test_nested_free_form_overrides_are_read_as_yaml():
    cfg = load_config(overrides=["model.kwargs={filters: [8, 8]}", "model.kwargs.hidden=16"])
    assert cfg.model.kwargs == {"filters": [8, 8], "hidden": 16}


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("dp.epsilon=abc", r"dp\.epsilon must be a number, got 'abc'"),
        ("optim.lr=[1, 2]", r"optim\.lr must be a number"),
        ("dp.batch_size=abc", r"dp\.batch_size must be an integer"),
        ("dp.batch_size=true", r"dp\.batch_size must be an integer"),
        ("optim.nesterov=1", r"optim\.nesterov must be true or false"),
        ("optim.betas=[0.9]", r"optim\.betas must be a list of 2 values"),
        ("optim.betas=[0.9, x]", r"optim\.betas\[1\] must be a number"),
        ("model.kwargs=[1, 2]", r"model\.kwargs must be a mapping"),
        ("dp.delta=null", r"dp\.delta must not be null"),
        ("dp.batch_size=null", r"dp\.batch_size must not be null"),
        ("train.steps=1.5", r"train\.steps must be an integer"),
    ],
)
def test_wrong_types_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=[override])


def test_integral_float_is_accepted_for_int():
    config = load_config(overrides=["dp.batch_size=512.0"])
    assert config.dp.batch_size == 512 and type(config.dp.batch_size) is int


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- unknown keys and malformed input -----------------------------------------------------


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["dp.epsilom=3"])
    message = str(err.value)
    assert "'dp.epsilom'" in message
    assert "did you mean dp.epsilon?" in message
    assert "valid keys:" in message and "noise_multiplier" in message


def test_unknown_key_in_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean optim\.momentum"):
        load_config(_write(tmp_path, "optim:\n  momentun: 0.9\n"))


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"unknown config key 'dpp'.*did you mean dp\?"):
        load_config(overrides=["dpp.epsilon=3"])
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'wandb'; valid keys: data, features, augment, model, dp",
    ):
        load_config(overrides=["wandb.project=x"])


@pytest.mark.parametrize("text", ["dp.epsilon", "=3", "  =3", ""])
def test_malformed_set(text):
    with pytest.raises(ConfigError, match="--set expects key=value"):
        load_config(overrides=[text])


def test_unparsable_set_value():
    with pytest.raises(ConfigError, match="cannot parse value"):
        load_config(overrides=["optim.betas=[0.9, 0.99"])


def test_setting_a_section_to_a_scalar():
    with pytest.raises(ConfigError, match="dp must be a mapping"):
        load_config(overrides=["dp=3"])
    with pytest.raises(ConfigError, match="dp is not a section"):
        load_config(overrides=["dp=3", "dp.epsilon=1"])


@pytest.mark.parametrize("text", ["- dp\n- optim\n", "just a string\n", "42\n"])
def test_yaml_file_not_a_mapping(tmp_path, text):
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(_write(tmp_path, text))


def test_yaml_section_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="optim must be a mapping"):
        load_config(_write(tmp_path, "optim: [1, 2]\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)  # a directory is not a config file


def test_invalid_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "dp: {epsilon: 3\n"))


# --- range validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["dp.epsilon=0"], r"dp\.epsilon must be a positive finite number"),
        (["dp.epsilon=-1"], r"dp\.epsilon must be a positive finite number"),
        (["dp.epsilon=.inf"], r"dp\.epsilon must be a positive finite number, got inf"),
        (["dp.epsilon=.nan"], r"dp\.epsilon must be a positive finite number"),
        (["dp.delta=1"], r"dp\.delta must be in \(0, 1\)"),
        (["dp.delta=1.5"], r"dp\.delta must be in \(0, 1\)"),
        (["dp.delta=0"], r"dp\.delta must be in \(0, 1\)"),
        (["dp.delta=-0.001"], r"dp\.delta must be in \(0, 1\)"),
        (["dp.noise_multiplier=-1"], r"dp\.noise_multiplier must be >= 0"),
        (["dp.noise_multiplier=.inf"], r"dp\.noise_multiplier must be >= 0"),
        (["dp.batch_size=0"], r"dp\.batch_size must be >= 1, got 0"),
        (["dp.batch_size=-5"], r"dp\.batch_size must be >= 1"),
        (["dp.sampling=random"], r"dp\.sampling must be poisson, fixed or shuffle, got 'random'"),
        (["dp.accountant=moments"], r"dp\.accountant must be pld or rdp, got 'moments'"),
        (["train.epochs=null"], r"set train\.epochs or train\.steps"),
        (["train.epochs=null", "train.steps=null"], r"set train\.epochs or train\.steps"),
        (["train.steps=0"], r"train\.steps must be >= 1"),
        (["train.epochs=0"], r"train\.epochs must be a positive finite number"),
        (
            ["train.max_physical_batch_size=0"],
            r"train\.max_physical_batch_size must be auto or an integer >= 1, got 0",
        ),
        (["optim.nesterov=true"], r"optim\.nesterov needs optim\.momentum > 0"),
        (
            ["optim.nesterov=true", "optim.momentum=0.9", "optim.dampening=0.1"],
            r"optim\.dampening = 0",
        ),
        (["dp.max_grad_norm=null"], r"a private run needs clipping"),
        (["dp.max_grad_norm=0"], r"dp\.max_grad_norm must be one positive number C"),
        (["dp.noise_multiplier=0"], r"non-private run and cannot meet dp\.epsilon"),
        (["dp.epsilon=null"], r"set dp\.epsilon .* or dp\.noise_multiplier"),
        (["optim.lr=0"], r"optim\.lr must be > 0"),
        (["optim.name=adagrad"], r"optim\.name must be sgd, adam or adamw"),
        (["optim.schedule=linear"], r"optim\.schedule must be constant or cosine"),
        (["optim.min_lr_ratio=1.5"], r"optim\.min_lr_ratio in \[0, 1\]"),
        (["dp.max_grad_norm_per=layer"], r"dp\.max_grad_norm_per must be 'group' .* or 'tensor'"),
        (
            [
                "dp.max_grad_norm_per=tensor",
                "dp.max_grad_norm=null",
                "dp.noise_multiplier=0",
                "dp.epsilon=null",
            ],
            r"dp\.max_grad_norm_per='tensor' clips each tensor to its norm: give max_grad_norm",
        ),
        (
            ["dp.max_grad_norm_per=tensor", "dp.clipping=adaptive"],
            r"not with dp\.max_grad_norm_per=tensor",
        ),
    ],
)
def test_bad_values(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "dp.noise_multiplier=0",
            "dp.epsilon=null",
            "dp.max_grad_norm=null",
        ],  # non-private baseline
        ["dp.noise_multiplier=0", "dp.epsilon=null"],  # non-private, clipped
        ["dp.noise_multiplier=1.1", "dp.epsilon=null"],  # fixed sigma, epsilon reported
        ["optim.nesterov=true", "optim.momentum=0.9"],
        ["train.epochs=null", "train.steps=10"],
        ["train.epochs=0", "train.steps=10"],  # steps override epochs
        ["dp.sampling=shuffle", "dp.accountant=rdp", "optim.name=adamw", "optim.schedule=cosine"],
        ["dp.delta=0.00001"],
        [
            "dp.max_grad_norm_per=tensor"
        ],  # a bound per tensor: the plan spells it out once the model is built
        ['dp.max_grad_norm={"features.*": 0.5, "*": 1.0}', "dp.max_grad_norm_per=tensor"],
    ],
)
def test_valid_edge_configs(overrides):
    load_config(overrides=overrides)


def test_validate_checks_directly_built_configs():
    from dataclasses import replace

    with pytest.raises(ConfigError, match="dp.delta"):
        validate(replace(Config(), dp=replace(DPConfig(), delta=2.0)))


# --- round trip -----------------------------------------------------------------------------


def _nondefault_config():
    return load_config(
        overrides=[
            "data.name=cifar10",
            "data.root=/data/cifar",
            "data.image_size=32",
            "features.extractor=scatternet",
            "features.normalize=datanorm",
            "features.norm_clip=[1.0, 1.5]",
            "features.norm_noise=6",
            "model.name=tramer-cifar-cnn",
            "model.activation=tempered_sigmoid(s=1.5,T=2,o=0.5)",
            "model.kwargs={hidden: 64, extra: [1, 2]}",
            "dp.epsilon=null",
            "dp.noise_multiplier=1.25",
            "dp.delta=0.000001",
            "dp.batch_size=1024",
            "dp.accountant=rdp",
            "optim.name=adam",
            "optim.betas=[0.85, 0.995]",
            "optim.lr=0.002",
            "optim.schedule=cosine",
            "optim.warmup_steps=10",
            "train.epochs=null",
            "train.steps=321",
            "run.seed=7",
            "run.threads=2",
        ]
    )


@pytest.mark.parametrize("make", [Config, _nondefault_config])
def test_round_trip_through_yaml(tmp_path, make):
    config = make()
    plain = config.to_dict()
    # Plain YAML: safe_dump must accept it (no tuples), and sections are the dataclass fields.
    assert list(plain) == [
        "data",
        "features",
        "augment",
        "model",
        "dp",
        "optim",
        "train",
        "run",
        "eval",
    ]
    assert plain["optim"]["betas"] == list(config.optim.betas)
    text = yaml.safe_dump(plain, sort_keys=False)
    reloaded = load_config(_write(tmp_path, text))
    assert reloaded == config
    assert isinstance(reloaded.optim.betas, tuple)


def test_save_config_round_trip(tmp_path):
    config = _nondefault_config()
    path = tmp_path / "config.yaml"
    save_config(config, path)
    assert load_config(path) == config
    assert yaml.safe_load(path.read_text())["dp"]["noise_multiplier"] == 1.25


# --- regressions (bugs found by these tests) ---------------------------------------------


def test_scientific_notation_without_dot_is_a_number(tmp_path):
    assert load_config(overrides=["dp.delta=1e-5"]).dp.delta == 1e-5
    assert load_config(_write(tmp_path, "dp:\n  delta: 1e-6\n")).dp.delta == 1e-6


@pytest.mark.parametrize("override", ["dp.batch_size=.inf", "train.steps=.nan", "run.seed=-.inf"])
def test_non_finite_int_is_a_config_error(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=[override])


def test_string_key_with_a_number_in_a_yaml_file_is_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  name: 5\n")
    with pytest.raises(ConfigError, match=r"data\.name must be a string"):
        load_config(path)


@pytest.mark.parametrize(
    "override, match",
    [
        ("features.extractor=sift", "features.extractor must be"),
        ("features.extractor=model:", "features.extractor must be"),
        ("features.normalize=batchnorm", "features.normalize must be"),
        ("features.groups=0", "features.groups"),
        ("features.norm_clip=[0.3, 0]", "norm_clip"),
        ("features.norm_clip=[0.3]", "list of 2"),
        ("features.norm_noise=-1", "norm_noise"),
        ("features.norm_floor=0", "norm_floor"),
        ("features.scatter_order=3", "scatter_order"),
        ("features.scatter_pad=-2", "scatter_pad"),
    ],
)
def test_bad_features_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_datanorm_without_noise_is_refused_for_a_private_run_only():
    with pytest.raises(ConfigError, match="exact statistics"):
        load_config(overrides=["features.normalize=datanorm", "features.norm_noise=0"])
    config = load_config(
        overrides=[
            "features.normalize=datanorm",
            "features.norm_noise=0",
            "dp.epsilon=null",
            "dp.noise_multiplier=0",
        ]
    )
    assert config.features.norm_noise == 0


@pytest.mark.parametrize(
    "override, match",
    [
        ("augment.multiplicity=0", "augment.multiplicity"),
        ("augment.type=mixup", "augment.type"),
        ("train.ema_decay=1", "ema_decay"),
        ("eval.augtest=true", "augtest"),
    ],
)
def test_bad_augment_and_ema_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])
