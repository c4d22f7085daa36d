"""The remote tier: any pyarrow filesystem (hdfs://, s3://, file://), with retries and a writer lease."""
