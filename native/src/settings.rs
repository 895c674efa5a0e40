//! The S3 client's settings, from the map source.S3Source.store_settings builds
//! for both paths (obstore's S3Store takes the same values as typed options).

use std::collections::HashMap;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::{BackoffConfig, ClientOptions, RetryConfig};
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

fn get<'a>(config: &'a HashMap<String, String>, key: &str) -> PyResult<&'a str> {
    config
        .get(key)
        .map(String::as_str)
        .ok_or_else(|| PyValueError::new_err(format!("native store settings lack {key:?}")))
}

fn number<T: std::str::FromStr>(config: &HashMap<String, String>, key: &str) -> PyResult<T> {
    let text = get(config, key)?;
    text.parse()
        .map_err(|_| PyValueError::new_err(format!("native store setting {key}={text:?} is not a number")))
}

fn flag(config: &HashMap<String, String>, key: &str) -> PyResult<bool> {
    Ok(get(config, key)? == "true")
}

fn millis(config: &HashMap<String, String>, key: &str) -> PyResult<Duration> {
    Ok(Duration::from_millis(number::<u64>(config, key)?))
}

/// An AmazonS3Builder as obstore's S3Store makes one: from the environment
/// first (obstore does the same), then the explicit settings on top.
pub fn builder(bucket: &str, config: &HashMap<String, String>) -> PyResult<AmazonS3Builder> {
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_region(get(config, "region")?)
        .with_virtual_hosted_style_request(flag(config, "virtual_hosted_style_request")?);
    if let Some(endpoint) = config.get("endpoint") {
        b = b.with_endpoint(endpoint);
    }
    let client = ClientOptions::new()
        .with_allow_http(flag(config, "allow_http")?)
        .with_connect_timeout(millis(config, "connect_timeout_ms")?)
        .with_timeout(millis(config, "timeout_ms")?)
        .with_pool_max_idle_per_host(number(config, "pool_max_idle_per_host")?);
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: millis(config, "init_backoff_ms")?,
            max_backoff: millis(config, "max_backoff_ms")?,
            base: number(config, "backoff_base")?,
        },
        max_retries: number(config, "max_retries")?,
        retry_timeout: millis(config, "retry_timeout_ms")?,
    };
    Ok(b.with_client_options(client).with_retry(retry))
}
